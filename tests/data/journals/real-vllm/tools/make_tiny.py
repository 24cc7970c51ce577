"""Make a tiny random Llama model with a locally trained byte-level BPE tokenizer (offline)."""
import os, sys, glob
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = sys.argv[1] if len(sys.argv) > 1 else "/opt/vllm-real/models/tiny"
LAYERS = int(sys.argv[2]) if len(sys.argv) > 2 else 2  # batch 4: 1 for tiny-1layer-weights
# Train on the Python standard library's own sources: local text, no download.
files = sorted(glob.glob("/usr/lib/python3.11/*.py"))[:60]
tok = Tokenizer(models.BPE(unk_token=None))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<s>", "</s>", "<pad>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train(files, trainer)
tok.post_processor = processors.TemplateProcessing(
    single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                               pad_token="<pad>", model_max_length=512)
fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
fast.save_pretrained(out)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=512,
                  num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                  max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                  tie_word_embeddings=False, torch_dtype="bfloat16")
model = LlamaForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
print("saved", out, sum(p.numel() for p in model.parameters()), "params")
