"""A tiny random GPT-2 (learned positions, no rotary embedding) sharing make_tiny.py's tokenizer.

Usage: python make_tiny_gpt2.py TINY_LLAMA_DIR OUT_DIR
SGLang 0.5.23 with --device cpu but without its CPU kernel package needs vllm's rotary kernel
for every RoPE model; GPT-2 has no RoPE, so it gets as far as loading weights on this host.
"""
import os, shutil, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from transformers import GPT2Config, GPT2LMHeadModel

src, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(os.path.join(src, f), out)
torch.manual_seed(0)
cfg = GPT2Config(vocab_size=1024, n_positions=512, n_embd=256, n_layer=2, n_head=4,
                 bos_token_id=0, eos_token_id=1, pad_token_id=2, torch_dtype="bfloat16")
model = GPT2LMHeadModel(cfg).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
print("saved", out, sum(p.numel() for p in model.parameters()), "params")
