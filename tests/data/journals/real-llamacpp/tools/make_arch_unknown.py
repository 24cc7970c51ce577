"""Copy a llama GGUF and rename its architecture in place to one this llama.cpp does not know.

Usage: python make_arch_unknown.py SRC.gguf DST.gguf [NEWARCH]   (NEWARCH: 5 letters, as "llama")
general.architecture and every "llama.*" key are renamed; same length, so no offset moves.
tokenizer.ggml.model (also "llama") is left alone. Stands in for a model newer than the build.
"""
import shutil
import sys

from gguf import GGUFReader

src, dst = sys.argv[1], sys.argv[2]
new = (sys.argv[3] if len(sys.argv) > 3 else "qwen9").encode()
assert len(new) == len(b"llama")
shutil.copyfile(src, dst)
reader = GGUFReader(dst, "r+")
for field in reader.fields.values():
    if field.name.startswith("llama."):
        key = field.parts[1]  # the key's bytes
        key[:len(new)] = list(new)
    if field.name == "general.architecture":
        value = field.parts[field.data[0]]
        assert bytes(value) == b"llama", bytes(value)
        value[:] = list(new)
reader.data.flush()
print({f.name: f.contents() for f in GGUFReader(dst).fields.values() if "context" in f.name
       or f.name == "general.architecture"})
