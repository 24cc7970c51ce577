"""The reader child's memory after a flood of large entries: `python -m bench.reader_memory`.

Writes `--entries` entries of `--mib` MiB for vllm.service (a repeated line, stored compressed as
journald stores it), `--per-file` to a journal file (journal-remote, rotated as journald rotates
a full file), once, into a temporary directory. Then, `--runs` times, interleaved, each child
follows that journal from its head as the daemon runs it (`JournalctlReader`, unit filter on)
until every entry arrived, and its /proc/PID/status is read: anonymous memory once everything is
read (`RssAnon`: what it keeps) and its peak resident set (`VmHWM`). The children: the native
reader installed with the package, `journalctl` (the baseline, the daemon's fallback child), and
any other build of the native reader given with `--native PATH` (e.g. an older commit's).
Medians per child, and each one's ratio to journalctl's. A run of journalctl takes ~7 min here
(the Python export parser with 16 MiB fields), one of the native reader ~4 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_supervisor.journal import reader as reader_module
from vllm_supervisor.journal.reader import JournalctlReader, ReaderSettings
from vllm_supervisor.journal.writer import JournalWriter, service_lines

UNIT = "vllm.service"
FOLLOW_TIMEOUT_S = 600.0


def write_flood(directory: Path, entries: int, mib: int, per_file: int) -> None:
    """`entries` lines of `mib` MiB, then one short line, `per_file` of them to a file."""
    with JournalWriter(directory) as writer:
        for n in range(entries):
            word = b"%d " % n
            # The newline at its end spares the writer a printable check of each byte.
            line = b"RuntimeError: flood %d " % n + word * (mib * (1 << 20) // len(word)) + b"\n"
            writer.write(service_lines(UNIT, "f" * 32, [line]))
            if n % per_file == per_file - 1:
                writer.rotate()
        writer.write(service_lines(UNIT, "f" * 32, ["after the flood"]))


def _status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if value.strip().endswith(" kB"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


async def follow_once(directory: Path, source: str, want: int) -> dict[str, float]:
    """Follow with one child until `want` entries arrived; its memory then, in MiB."""
    reader = JournalctlReader(
        ReaderSettings(directory=directory, units=(UNIT,), start_at="head", source=source)
    )
    got = 0
    stop = asyncio.Event()

    async def collect() -> None:
        nonlocal got
        async for batch in reader.batches(stop):
            got += len(batch)

    task = asyncio.create_task(collect())
    started = time.monotonic()
    try:
        while got < want:
            if time.monotonic() - started > FOLLOW_TIMEOUT_S:
                raise TimeoutError(f"{source}: {got} of {want} entries")
            await asyncio.sleep(0.01)  # a poll interval: the count decides
        seconds = time.monotonic() - started
        if reader.can_sync:
            await reader.sync(60)  # its end-of-pass work done, as when the daemon goes idle
        assert reader._process is not None  # it runs while following
        status = _status(reader._process.pid)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    mib = 1 << 20
    return {
        "rss_anon_mib": status["RssAnon"] / mib,
        "peak_rss_mib": status["VmHWM"] / mib,
        "seconds": seconds,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    children: dict[str, tuple[str, Path]] = {
        "native": ("native", reader_module.NATIVE_READER),
        "journalctl": ("journalctl", reader_module.NATIVE_READER),
    }
    for path in args.native:
        children[f"native@{path}"] = ("native", path)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in children}
    installed = reader_module.NATIVE_READER
    with tempfile.TemporaryDirectory(prefix="vllm-supervisor-bench-") as tmp:
        journal = Path(tmp) / "journal"
        write_flood(journal, args.entries, args.mib, args.per_file)
        try:
            for _ in range(args.runs):
                for name, (source, program) in children.items():
                    reader_module.NATIVE_READER = program
                    runs[name].append(asyncio.run(follow_once(journal, source, args.entries + 1)))
        finally:
            reader_module.NATIVE_READER = installed
    medians = {
        name: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for name, results in runs.items()
    }
    baseline = medians["journalctl"]
    for figures in medians.values():
        for key in ("rss_anon_mib", "peak_rss_mib"):
            figures[f"{key}_vs_journalctl"] = figures[key] / baseline[key]
    return {
        "entries": args.entries,
        "mib_each": args.mib,
        "files": -(-args.entries // args.per_file),
        "runs": args.runs,
        "median": medians,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reader_memory", description=__doc__)
    parser.add_argument("--entries", type=int, default=60)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--per-file", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--native", type=Path, action="append", default=[], metavar="PATH")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
