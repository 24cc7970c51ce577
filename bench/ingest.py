"""One measured read of a journal directory, run in a fresh interpreter per run.

`python -m bench.ingest MODE DIRECTORY UNIT` prints one JSON object. A fresh process per run makes
`getrusage(RUSAGE_SELF)` and `getrusage(RUSAGE_CHILDREN)` (the journalctl child, once reaped) the
exact CPU and peak RSS of that run alone. Imports and the signature table load happen before the
clock starts; the journalctl child is started inside the measured window.

Modes:
- `supervisor`: the daemon's ingest path: `JournalctlReader` (with its default child, the native
  libsystemd reader) -> `Pipeline.feed` (tracker, classifier, policy), as `triage.collect` and
  `Daemon._follow` run it, with the unit filter.
- `supervisor_journalctl`: the same with `[journal] reader = "journalctl"` (the fallback).
- `json`: the baseline: `journalctl -o json -u UNIT` read line by line with `json.loads`, the way
  log shippers that run journalctl (Vector, Filebeat) consume it.
- `export`: `journalctl -o export -u UNIT > /dev/null`: every field, nothing parsed (the ceiling
  of any journalctl-based reader).
- `export_fields`: as `export`, with the reader's `--output-fields` list.
- `native`: the native reader child alone, `> /dev/null` (the ceiling of our own reader).

`python -m bench.ingest rss DIRECTORY UNIT TOTAL` streams the journal again and again through one
`Pipeline` (a new reader child each pass, as after restarts) until TOTAL entries were fed, and
reports the RSS then: memory must not grow with history.
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

MODES = ("supervisor", "supervisor_journalctl", "json", "export", "export_fields", "native")
# Optional (`pip install -e '.[bench]'`): the libsystemd bindings, every field decoded.
PEER_MODES = ("python_systemd", "cysystemd")


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
        return _supervisor(directory, unit, source="native")
    if mode == "supervisor_journalctl":
        return _supervisor(directory, unit, source="journalctl")
    if mode == "native":
        return lambda: _native_devnull(directory, unit)
    if mode == "json":
        return lambda: _json(directory, unit)
    if mode == "python_systemd":
        return lambda: _python_systemd(directory, unit)
    if mode == "cysystemd":
        return lambda: _cysystemd(directory, unit)
    if mode in ("export", "export_fields"):
        return lambda: _devnull(directory, unit, fields=mode == "export_fields")
    raise SystemExit(f"unknown mode {mode!r}; one of {', '.join(MODES)}")


def _supervisor(directory: Path, unit: str, *, source: str) -> Any:
    from vllm_supervisor.classify.table import load_table
    from vllm_supervisor.config import Config, UnitConfig
    from vllm_supervisor.journal.reader import ReaderSettings, read_all
    from vllm_supervisor.model import Outcome
    from vllm_supervisor.pipeline import Pipeline

    config = Config(units=(UnitConfig(name=unit),))
    table = load_table(config)
    classify_s: list[float] = []

    def observe(outcome: Outcome, seconds: float) -> None:
        classify_s.append(seconds)

    pipeline = Pipeline(config, table, observer=observe)
    # The settings `triage._from_journal` and `app.reader_settings` build (no follow).
    settings = ReaderSettings(
        units=(unit,),
        directory=directory,
        journalctl=config.journal.journalctl,
        source=source,
        follow=False,
        max_line_chars=config.tracker.max_line_chars,
    )

    async def run() -> tuple[int, list[Outcome]]:
        count = 0
        outcomes: list[Outcome] = []
        async for batch in read_all(settings):
            count += len(batch)
            outcomes += pipeline.decide_all(pipeline.feed(batch))
        return count, outcomes + pipeline.decide_all(pipeline.finish())

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


def _python_systemd(directory: Path, unit: str) -> tuple[int, dict[str, Any]]:
    """systemd's binding with journalctl --unit's matches, each entry decoded to a dict."""
    from systemd import journal

    reader = journal.Reader(path=str(directory))
    reader.add_match(_SYSTEMD_UNIT=unit)
    reader.add_disjunction()
    reader.add_match(_PID="1", UNIT=unit)
    reader.add_disjunction()
    reader.add_match(_UID="0", OBJECT_SYSTEMD_UNIT=unit)
    count = sum(1 for _ in reader)
    return count, {}


def _cysystemd(directory: Path, unit: str) -> tuple[int, dict[str, Any]]:
    """The Cython binding, the same matches, each entry's fields read."""
    from cysystemd.reader import JournalReader, Rule

    reader = JournalReader()
    reader.open_directory(str(directory))
    rules = (
        Rule("_SYSTEMD_UNIT", unit)
        | (Rule("_PID", "1") & Rule("UNIT", unit))
        | (Rule("_UID", "0") & Rule("OBJECT_SYSTEMD_UNIT", unit))
    )
    reader.add_filter(rules)
    reader.seek_head()
    count = 0
    for record in reader:
        _ = record.data
        count += 1
    return count, {}


def _devnull(directory: Path, unit: str, *, fields: bool) -> tuple[int, dict[str, Any]]:
    from vllm_supervisor.journal.reader import ReaderSettings, journalctl_argv

    if fields:
        argv = journalctl_argv(
            ReaderSettings(units=(unit,), directory=directory, follow=False), None
        )
    else:
        argv = ["journalctl", "-o", "export", f"--directory={directory}", f"--unit={unit}"]
    subprocess.run(argv, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, check=True)
    return 0, {}  # the caller knows how many entries the filter returns


def _native_devnull(directory: Path, unit: str) -> tuple[int, dict[str, Any]]:
    from vllm_supervisor.journal.reader import ReaderSettings, native_argv, native_input

    settings = ReaderSettings(units=(unit,), directory=directory, follow=False)
    argv = native_argv(settings, None)
    subprocess.run(argv, stdout=subprocess.DEVNULL, input=native_input(settings), check=True)
    return 0, {}


def measure_rss(directory: Path, unit: str, total: int) -> dict[str, Any]:
    """Feed one Pipeline pass after pass over the journal until `total` entries; RSS then."""
    from vllm_supervisor.classify.table import load_table
    from vllm_supervisor.config import Config, UnitConfig
    from vllm_supervisor.journal.reader import ReaderSettings, read_all
    from vllm_supervisor.pipeline import Pipeline

    config = Config(units=(UnitConfig(name=unit),))
    pipeline = Pipeline(config, load_table(config))
    settings = ReaderSettings(units=(unit,), directory=directory, follow=False, source="auto")
    rss_mb: list[float] = []  # after each pass

    async def run() -> int:
        count = 0
        while count < total:
            async for batch in read_all(settings):
                count += len(batch)
                pipeline.feed(batch)
            rss_mb.append(_vm_kb("VmRSS") / 1024)
        return count

    started = time.perf_counter()
    count = asyncio.run(run())
    _, _, _, rss_kids = _usage()
    return {
        "mode": "rss",
        "entries": count,
        "passes": len(rss_mb),
        "wall_s": time.perf_counter() - started,
        "rss_mb_after_each_pass": [round(r, 1) for r in rss_mb],
        "rss_mb_end": _vm_kb("VmRSS") / 1024,
        "rss_mb_peak": _vm_kb("VmHWM") / 1024,
        "rss_child_mb_peak": rss_kids / 1024,
    }


def _vm_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def main(argv: list[str]) -> int:
    """`python -m bench.ingest MODE DIRECTORY UNIT` or `... rss DIRECTORY UNIT TOTAL`."""
    if argv[0] == "rss":
        _, directory, unit, total = argv
        print(json.dumps(measure_rss(Path(directory), unit, int(total))))
        return 0
    mode, directory, unit = argv
    print(json.dumps(measure(mode, Path(directory), unit)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
