"""Give the start's garbage back to the system once the daemon follows the journal.

Starting parses the config and the signature table, compiles patterns, reads the journal's tail
and imports everything: temporaries that Python frees but glibc's allocator keeps in its heap.
An idle daemon's RSS should be what it uses, so after the start: collect, then `malloc_trim`
(glibc; ~0.4 MB here). A plain C call through ctypes: no callback, no writable-executable
memory (the unit has MemoryDenyWriteExecute=yes).
"""

from __future__ import annotations

import gc


def give_back_startup_memory() -> bool:
    """Collect garbage and return free heap pages to the system; False where not glibc."""
    gc.collect()
    try:
        import ctypes

        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False  # another C library: nothing to trim
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True
