"""Copy a GGUF and set one uint32 metadata value in place.

Usage: python gguf_set_u32.py SRC.gguf DST.gguf KEY VALUE
(here: llama.attention.head_count 3, so the stored q/k/v weights no longer fit the shape).
"""
import shutil
import sys

from gguf import GGUFReader

src, dst, key, value = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
shutil.copyfile(src, dst)
reader = GGUFReader(dst, "r+")
field = reader.fields[key]
field.parts[field.data[0]][0] = value
reader.data.flush()
print(key, GGUFReader(dst).fields[key].contents())
