"""One measured read of a journal directory, run in a fresh interpreter per run.

`python -m bench.ingest MODE DIRECTORY UNIT` prints one JSON object. A fresh process per run makes
`getrusage(RUSAGE_SELF)` and `getrusage(RUSAGE_CHILDREN)` (the journalctl child, once reaped) the
exact CPU and peak RSS of that run alone. Imports and the signature table load happen before the
clock starts; the journalctl child is started inside the measured window.

Modes:
- `supervisor`: the daemon's ingest path: `JournalctlReader` (the journalctl child with the
  daemon's argv) -> `Pipeline.feed` (tracker, classifier, policy), as `triage.collect` and
  `Daemon._follow` run it, with the unit filter.
- `json`: the baseline: `journalctl -o json -u UNIT` read line by line with `json.loads`, the way
  log shippers that run journalctl (Vector, Filebeat) consume it.
- `export`: `journalctl -o export -u UNIT > /dev/null`: every field, nothing parsed (the ceiling
  of any journalctl-based reader).
- `export_fields`: as `export`, with the reader's `--output-fields` list.
"""

from __future__ import annotations

import asyncio
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("supervisor", "json", "export", "export_fields")


def _usage() -> tuple[float, float, int, int]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (
        me.ru_utime + me.ru_stime,
        kids.ru_utime + kids.ru_stime,
        me.ru_maxrss,
        kids.ru_maxrss,
    )


def measure(mode: str, directory: Path, unit: str) -> dict[str, Any]:
    """Read the journal once in `mode`; entries, wall and CPU seconds, peak RSS."""
    runner = _prepare(mode, directory, unit)
    self0, kids0, _, _ = _usage()
    started = time.perf_counter()
    entries, extra = runner()
    wall = time.perf_counter() - started
    self1, kids1, rss_self, rss_kids = _usage()
    return {
        "mode": mode,
        "entries": entries,
        "wall_s": wall,
        "cpu_self_s": self1 - self0,
        "cpu_journalctl_s": kids1 - kids0,
        "rss_self_kb": rss_self,
        "rss_journalctl_kb": rss_kids,
        **extra,
    }


def _prepare(mode: str, directory: Path, unit: str) -> Any:
    if mode == "supervisor":
        return _supervisor(directory, unit)
    if mode == "json":
        return lambda: _json(directory, unit)
    if mode in ("export", "export_fields"):
        return lambda: _devnull(directory, unit, fields=mode == "export_fields")
    raise SystemExit(f"unknown mode {mode!r}; one of {', '.join(MODES)}")


def _supervisor(directory: Path, unit: str) -> Any:
    from supervisor.app import load_table
    from supervisor.config import Config, UnitConfig
    from supervisor.journal.reader import ReaderSettings, read_all
    from supervisor.model import Outcome
    from supervisor.pipeline import Pipeline

    config = Config(units=(UnitConfig(name=unit),))
    table = load_table(config)
    classify_s: list[float] = []

    def observe(outcome: Outcome, seconds: float) -> None:
        classify_s.append(seconds)

    pipeline = Pipeline(config, table, observer=observe)
    # The settings `triage._from_journal` and `Daemon._reader_settings` build (no follow).
    settings = ReaderSettings(
        units=(unit,),
        directory=directory,
        journalctl=config.journal.journalctl,
        follow=False,
        max_line_chars=config.tracker.max_line_chars,
    )

    async def run() -> tuple[int, list[Outcome]]:
        count = 0
        outcomes: list[Outcome] = []
        async for batch in read_all(settings):
            count += len(batch)
            outcomes += pipeline.feed(batch)
        return count, outcomes + pipeline.finish()

    def runner() -> tuple[int, dict[str, Any]]:
        count, outcomes = asyncio.run(run())
        crashed = [o for o in outcomes if o.invocation.failed or o.verdict.crashed]
        return count, {
            "invocations": len(outcomes),
            "crashed": len(crashed),
            "signatures": sorted({o.verdict.signature or "-" for o in crashed}),
            "halts": sum(o.decision.action.value == "halt" for o in outcomes),
            "classify_ms": [round(s * 1000, 3) for s in classify_s],
        }

    return runner


def _json(directory: Path, unit: str) -> tuple[int, dict[str, Any]]:
    argv = ["journalctl", "-o", "json", f"--directory={directory}", f"--unit={unit}", "--no-pager"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert process.stdout is not None
    count = 0
    loads = json.loads
    for line in process.stdout:
        record = loads(line)
        count += 1
    del record
    process.wait()
    return count, {}


def _devnull(directory: Path, unit: str, *, fields: bool) -> tuple[int, dict[str, Any]]:
    from supervisor.journal.reader import ReaderSettings, journalctl_argv

    if fields:
        argv = journalctl_argv(
            ReaderSettings(units=(unit,), directory=directory, follow=False), None
        )
    else:
        argv = ["journalctl", "-o", "export", f"--directory={directory}", f"--unit={unit}"]
    subprocess.run(argv, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, check=True)
    return 0, {}  # the caller knows how many entries the filter returns


def main(argv: list[str]) -> int:
    """`python -m bench.ingest MODE DIRECTORY UNIT`."""
    mode, directory, unit = argv
    print(json.dumps(measure(mode, Path(directory), unit)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
