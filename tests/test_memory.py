"""Giving the start's memory back: safe to call, and it returns freed heap to the system."""

from __future__ import annotations

from pathlib import Path

from vllm_supervisor.util.memory import give_back_startup_memory


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_freed_heap_goes_back_to_the_system() -> None:
    """Memory Python freed but glibc kept (many mid-sized blocks) is returned by the call."""
    blocks = [bytearray(600) for _ in range(100_000)]  # ~60 MB through malloc, not pymalloc
    keep = blocks[::1000]  # a few survivors pin the heap's top: no automatic trim
    del blocks
    before = _rss_kb()
    assert give_back_startup_memory()
    after = _rss_kb()
    assert before - after > 20_000, (before, after)
    assert len(keep) == 100
