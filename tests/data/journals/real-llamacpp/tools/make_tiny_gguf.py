"""Make a tiny random Llama model offline and convert it to GGUF with llama.cpp's own converter.

Usage: python make_tiny_gguf.py OUTDIR LLAMA_CPP_SRC
Writes OUTDIR/hf (config.json, model.safetensors, tokenizer.model) and OUTDIR/tiny-f16.gguf.
The shape is the one of real-vllm/tools/make_tiny.py (LlamaForCausalLM, 2 layers, hidden 256,
4 heads, vocab 1024), but the tokenizer is a SentencePiece BPE model (byte fallback) trained on
the local Python standard library: llama.cpp's converter reads tokenizer.model directly, while a
byte-level BPE tokenizer.json made here would have a pre-tokenizer hash it does not know.
"""
import glob
import os
import subprocess
import sys

os.environ["HF_HUB_OFFLINE"] = "1"
import sentencepiece as spm  # noqa: E402
import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

out, src = sys.argv[1], sys.argv[2]
hf = os.path.join(out, "hf")
os.makedirs(hf, exist_ok=True)
corpus = os.path.join(out, "corpus.txt")
with open(corpus, "w") as f:
    for path in sorted(glob.glob("/usr/lib/python3.11/*.py"))[:60]:
        f.write(open(path, encoding="utf-8", errors="replace").read())
spm.SentencePieceTrainer.train(
    input=corpus, model_prefix=os.path.join(hf, "tokenizer"), vocab_size=1024, model_type="bpe",
    byte_fallback=True, character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
    max_sentence_length=100000, input_sentence_size=200000, shuffle_input_sentence=False)
os.remove(os.path.join(hf, "tokenizer.vocab"))
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False, torch_dtype="bfloat16")
model = LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(hf, safe_serialization=True)
print("saved", hf, sum(p.numel() for p in model.parameters()), "params")
subprocess.run([sys.executable, os.path.join(src, "convert_hf_to_gguf.py"), hf, "--outtype",
                "f16", "--outfile", os.path.join(out, "tiny-f16.gguf")], check=True)
