"""The journals `bench.scale` measures on, written by systemd-journal-remote and cached by shape.

- `units_journal(n)`: n units, each one start logging `LINES_PER_UNIT` vLLM-like lines (what a
  unit costs the daemon while it serves), and the seed crash of units 1, 64, 65, 100 and 500
  (those up to n), after every unit has logged: each must be decided once.
- `backlog_journal(entries, share)`: a busy host's journal after downtime: `UNIT` is `share` of
  it (1 %), 20 other units the rest, every entry with journald's trusted fields; `UNIT` crashes
  at 10, 30, 50, 70 and 90 % of it (the seed log, PID 1's messages, a restart).
- `lines_journal(units, size)`: 8 units each logging `ERROR_LINES` error lines of `size` bytes
  (priority 3, so every one is a line the tracker keeps while its run is open).

The bulk goes through `bench.generate.Encoder` (the constant fields encoded once).
"""

from __future__ import annotations

import json
import random
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.generate import Encoder, cache_root, finish_remote, seed_lines, start_remote
from bench.generate import stdout_fields as _stdout_fields
from vllm_supervisor.journal.writer import crashed_invocation, start_entries

UNIT = "vllm.service"
VERSION = 1  # bump when the content changes: the cache is keyed by it
CRASHING_UNITS = (1, 64, 65, 100, 500)  # 1-based, as the issue counts them
LINES_PER_UNIT = 600  # fills the tracker's head (200) and tail (400) windows of a unit
BACKLOG_CRASHES_AT = (0.1, 0.3, 0.5, 0.7, 0.9)
ERROR_LINES = 2700  # past head + tail + error lines (200 + 400 + 2000) of one invocation
LINE_UNITS = 8
OTHER_UNITS = 20


@dataclass(frozen=True, slots=True, kw_only=True)
class ScaleJournal:
    """A generated journal directory and what it holds."""

    directory: Path
    entries: int
    units: tuple[str, ...]  # the units to supervise on it
    crashes: int  # crashed invocations of those units: each must be decided
    bytes_on_disk: int


def unit_name(number: int) -> str:
    """The n-th supervised unit of the units journal (1-based)."""
    return f"serve-{number:04d}.service"


def units_journal(units: int, *, root: Path | None = None) -> ScaleJournal:
    """`units` units serving, the crashing ones among them crashed after all had logged."""
    names = tuple(unit_name(n) for n in range(1, units + 1))
    crashing = [n for n in CRASHING_UNITS if n <= units]

    def write(encoder: Encoder) -> Iterator[bytes]:
        rnd = random.Random(units)
        for number in range(1, units + 1):
            inv = uuid.uuid4().hex
            for fields in start_entries(unit_name(number), inv):
                yield encoder.entry(fields)
            constant = _stdout_fields(
                unit_name(number), inv, 3000 + number, comm="python3", cmdline=_CMDLINE
            )
            for _ in range(LINES_PER_UNIT):
                yield encoder.line(constant, _request_line(rnd))
        for number in crashing:
            for fields in crashed_invocation(
                unit_name(number), seed_lines(), restarts=1, pid=9000 + number
            ):
                yield encoder.entry(fields)

    key = f"units-{units}"
    return _cached(key, root, names, len(crashing), write)


def backlog_journal(entries: int, share: float, *, root: Path | None = None) -> ScaleJournal:
    """`entries` entries of which `share` are `UNIT`'s, with its crashes spread through them."""
    crash_at = [int(entries * at) for at in BACKLOG_CRASHES_AT]

    def write(encoder: Encoder) -> Iterator[bytes]:
        rnd = random.Random(entries)
        others = [
            _stdout_fields(
                f"worker-{k:02d}.service",
                uuid.uuid4().hex,
                2000 + k,
                comm="python3",
                cmdline=f"/usr/bin/python3 -m worker --shard {k}",
            )
            for k in range(OTHER_UNITS)
        ]
        inv = uuid.uuid4().hex
        ours = _stdout_fields(UNIT, inv, 3100, comm="python3", cmdline=_CMDLINE)
        crash = 0
        for fields in start_entries(UNIT, inv):
            yield encoder.entry(fields)
        written = 2
        while written < entries:
            if crash < len(crash_at) and written >= crash_at[crash]:
                crash += 1
                for fields in crashed_invocation(
                    UNIT, seed_lines(), restarts=crash, pid=7000 + crash
                ):
                    yield encoder.entry(fields)
                    written += 1
                inv = uuid.uuid4().hex  # the restart: a new invocation serving
                ours = _stdout_fields(UNIT, inv, 3100 + crash, comm="python3", cmdline=_CMDLINE)
                for fields in start_entries(UNIT, inv):
                    yield encoder.entry(fields)
                    written += 1
                continue
            constant = ours if rnd.random() < share else others[written % OTHER_UNITS]
            yield encoder.line(constant, _request_line(rnd))
            written += 1

    key = f"backlog-{entries}-{share:g}"
    return _cached(key, root, (UNIT,), len(crash_at), write)


def lines_journal(size: int, *, root: Path | None = None) -> ScaleJournal:
    """`LINE_UNITS` units each logging `ERROR_LINES` error lines of `size` bytes (still open)."""
    names = tuple(unit_name(n) for n in range(1, LINE_UNITS + 1))

    def write(encoder: Encoder) -> Iterator[bytes]:
        for number in range(1, LINE_UNITS + 1):
            inv = uuid.uuid4().hex
            for fields in start_entries(unit_name(number), inv):
                yield encoder.entry(fields)
        constants = [
            _stdout_fields(unit_name(n), uuid.uuid4().hex, 3000 + n, comm="python3",
                           cmdline=_CMDLINE).replace(b"PRIORITY=6", b"PRIORITY=3")
            for n in range(1, LINE_UNITS + 1)
        ]  # fmt: skip
        filler = b"x" * size
        for k in range(ERROR_LINES):
            for number, constant in enumerate(constants, start=1):
                head = b"RuntimeError: unit %d line %d: " % (number, k)
                yield encoder.line(constant, (head + filler)[:size])

    key = f"lines-{size}"
    return _cached(key, root, names, 0, write)


_CMDLINE = "/opt/vllm/bin/python3 -m vllm.entrypoints.openai.api_server --port 8000"
_WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "summarize")


def _request_line(rnd: random.Random) -> bytes:
    prompt = " ".join(rnd.choices(_WORDS, k=rnd.randint(5, 30)))
    return (
        f"(APIServer pid=3100) INFO 12-01 10:00:00 [logger.py:43] Received request "
        f"chatcmpl-{rnd.getrandbits(64):016x}: prompt: {prompt!r}, params: SamplingParams(n=1)"
    ).encode()


def _cached(
    key: str,
    root: Path | None,
    units: tuple[str, ...],
    crashes: int,
    write: Callable[[Encoder], Iterator[bytes]],
) -> ScaleJournal:
    """The journal `key` from the cache, written through journal-remote when missing."""
    base = (root or cache_root()) / f"scale-{key}-v{VERSION}"
    meta = base / "meta.json"
    if not meta.exists():
        shutil.rmtree(base, ignore_errors=True)
        (base / "journal").mkdir(parents=True)
        print(f"  writing journal {key} ...", flush=True)
        started = time.perf_counter()
        remote = start_remote(base / "journal")
        assert remote.stdin is not None
        encoder = Encoder(start_us=int((time.time() - 86400 * 3) * 1e6))
        chunk: list[bytes] = []
        for data in write(encoder):
            chunk.append(data)
            if len(chunk) >= 4096:
                remote.stdin.write(b"".join(chunk))
                chunk.clear()
        remote.stdin.write(b"".join(chunk))
        finish_remote(remote)
        size = sum(p.stat().st_size for p in (base / "journal").iterdir())
        meta.write_text(json.dumps({"entries": encoder.seqnum, "bytes_on_disk": size}))
        print(
            f"  {encoder.seqnum:,} entries, {size / 1e6:,.0f} MB, "
            f"{time.perf_counter() - started:.0f} s",
            flush=True,
        )
    data = json.loads(meta.read_text())
    return ScaleJournal(
        directory=base / "journal",
        entries=data["entries"],
        units=units,
        crashes=crashes,
        bytes_on_disk=data["bytes_on_disk"],
    )
