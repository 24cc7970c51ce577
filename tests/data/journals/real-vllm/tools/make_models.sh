#!/bin/sh
# Batch 4's copies of the tiny model (run after make_tiny.py made models/tiny).
set -eu
M=/var/tmp/vllm-venv/models
PY=/var/tmp/vllm-venv/cpu/bin/python
cd $M
rm -rf tiny-modeltype tiny-tokjson-half tiny-1layer-weights tiny-remote-syntaxerror tiny-1layer-src
# unknown model_type
cp -a tiny tiny-modeltype
$PY - <<'P'
import json; p="/var/tmp/vllm-venv/models/tiny-modeltype/config.json"
c=json.load(open(p)); c["model_type"]="tinyfoo"; json.dump(c, open(p,"w"), indent=2)
P
# tokenizer.json cut in half
cp -a tiny tiny-tokjson-half
truncate -s $(( $(stat -c %s tiny/tokenizer.json) / 2 )) tiny-tokjson-half/tokenizer.json
# weights made for 1 layer, config.json (tiny's) says 2
$PY "$(dirname "$0")/make_tiny.py" $M/tiny-1layer-src 1
cp -a tiny tiny-1layer-weights
cp tiny-1layer-src/model.safetensors tiny-1layer-weights/model.safetensors
rm -rf tiny-1layer-src
# trust-remote-code config module with a SyntaxError
cp -a tiny tiny-remote-syntaxerror
$PY - <<'P'
import json; d="/var/tmp/vllm-venv/models/tiny-remote-syntaxerror/"
c=json.load(open(d+"config.json"))
c["auto_map"]={"AutoConfig": "configuration_tiny_remote.TinyRemoteConfig"}
json.dump(c, open(d+"config.json","w"), indent=2)
open(d+"configuration_tiny_remote.py","w").write(
"from transformers import LlamaConfig\n\n\n"
"class TinyRemoteConfig(LlamaConfig):\n"
"    model_type = \"llama\"\n\n"
"    def __init__(self, rope_scaling_factor=1.0, **kwargs)\n"
"        self.rope_scaling_factor = rope_scaling_factor\n"
"        super().__init__(**kwargs)\n")
P
chmod 755 tiny-*; chmod 644 tiny-*/*
ls -la $M/*
