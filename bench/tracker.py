"""CPU per entry through `InvocationTracker.feed`, this tree against another commit's, same run.

`python -m bench.tracker [--baseline REF] [--runs K] [--entries N] [--ingest]` exports REF's
`supervisor/` (default `main`) to a temporary directory, then runs the same workload through each
tree's tracker in a fresh interpreter per run, interleaved (A B A B ...), and prints the medians
and their ratio as JSON. The entries are built before the clock starts; only `feed` is timed.
`--ingest` also reads bench.generate's journal (200k entries) through each tree's whole ingest
path (`python -m bench.ingest supervisor`: native reader, `Pipeline.feed`, decisions), CPU per
unit entry of the supervisor process, interleaved the same way.

The workload is what the tracker sees from busy engines: 8 units taking turns in bursts of
`BURST` lines, each a long run of request lines (every 20th an error, every 200th a traceback
frame, now and then a serving line), and every `CRASH_EVERY` lines one unit crashes: PID 1's
exit, failure, restart scheduled and next start, the next run's lines read while the ended one
settles. `python -m bench.tracker worker PATH N` is one
measured run of the tree whose `vllm_supervisor` package is in PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
UNITS = 8
CRASH_EVERY = 5_000  # lines between two crashes (of one unit, round robin)
BURST = 16  # lines one unit logs before the next one does


def workload(count: int) -> list[Any]:
    """The entries, built with the imported tree's model."""
    from vllm_supervisor.model import JournalEntry, LifecycleEvent

    entries: list[Any] = []
    invocation = [0] * UNITS
    at = 1_700_000_000_000_000

    def inv(u: int) -> str:
        return f"{u:08x}{invocation[u]:024x}"

    def pid1(u: int, kind: LifecycleEvent, **fields: str) -> Any:
        return JournalEntry(
            cursor=f"c{len(entries)}",
            realtime_us=at,
            message=f"serve-{u}.service: {kind.name}",
            unit=f"serve-{u}.service",
            invocation_id=inv(u),
            pid=1,
            from_pid1=True,
            message_id=kind.value,
            fields=fields,
        )

    for n in range(count):
        at += 100
        u = (n // BURST) % UNITS
        if n % CRASH_EVERY == CRASH_EVERY - 1:
            crashed = (n // CRASH_EVERY) % UNITS
            entries.append(pid1(crashed, LifecycleEvent.PROCESS_EXITED, EXIT_CODE="exited",
                                EXIT_STATUS="1", COMMAND="ExecStart"))  # fmt: skip
            entries.append(pid1(crashed, LifecycleEvent.UNIT_FAILED, UNIT_RESULT="exit-code"))
            entries.append(pid1(crashed, LifecycleEvent.RESTART_SCHEDULED, N_RESTARTS="1"))
            invocation[crashed] += 1
            entries.append(pid1(crashed, LifecycleEvent.STARTING, JOB_TYPE="start"))
            entries.append(pid1(crashed, LifecycleEvent.JOB_STARTED, JOB_RESULT="done"))
        if n % 200 == 7:
            text = '  File "/opt/vllm/engine.py", line 42, in step'
        elif n % 20 == 0:
            text = f"ERROR 07-01 12:00:00 request {n}: upstream closed the connection"
        elif n % 997 == 5:
            text = "INFO:     Uvicorn running on http://0.0.0.0:8000 (Press CTRL+C to quit)"
        else:
            text = f"INFO 07-01 12:00:00 [logger.py:43] Received request cmpl-{n}: prompt len 812"
        entries.append(
            JournalEntry(
                cursor=f"c{len(entries)}",
                realtime_us=at,
                message=text,
                unit=f"serve-{u}.service",
                invocation_id=inv(u),
                pid=3000 + u * 10 + invocation[u] % 10,
                priority=3 if text.startswith("ERROR") else 6,
            )
        )
    return entries


def worker(count: int) -> dict[str, Any]:
    from vllm_supervisor.track.tracker import InvocationTracker

    entries = workload(count)
    tracker = InvocationTracker()
    ended = 0
    started = time.process_time()
    for entry in entries:
        ended += len(tracker.feed(entry))
    cpu = time.process_time() - started
    return {"us_per_entry": cpu / len(entries) * 1e6, "entries": len(entries), "ended": ended}


def _export(ref: str, into: Path) -> Path:
    """REF's supervisor/ as an importable `vllm_supervisor` beside its config/ (with this
    tree's built C parts)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "supervisor", "config"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    package = into / "vllm_supervisor"
    (into / "supervisor").rename(package)
    built = [*(ROOT / "supervisor").rglob("*.so"), *(ROOT / "supervisor").rglob("*-reader")]
    for path in built:
        shutil.copy2(path, package / path.relative_to(ROOT / "supervisor"))
    return into


def _run(path: Path, count: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "bench.tracker", "worker", str(path), str(count)],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def _ingest(path: Path, journal: Path) -> float:
    """One `bench.ingest supervisor` run of the tree in `path`: CPU us per unit entry."""
    from bench.generate import UNIT

    env = {**os.environ, "PYTHONPATH": str(path)}
    out = subprocess.run(
        [sys.executable, "-m", "bench.ingest", "supervisor", str(journal), UNIT],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    ).stdout
    result = json.loads(out)
    return float(result["cpu_self_s"]) / result["entries"] * 1e6


def _compare(name: str, here: list[float], there: list[float]) -> dict[str, Any]:
    this, that = statistics.median(here), statistics.median(there)
    return {
        f"{name}_us_this": round(this, 3),
        f"{name}_us_baseline": round(that, 3),
        f"{name}_ratio_this_to_baseline": round(this / that, 3),
        f"{name}_this_runs": [round(x, 3) for x in here],
        f"{name}_baseline_runs": [round(x, 3) for x in there],
    }


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["worker"]:
        sys.path.insert(0, args[1])
        print(json.dumps(worker(int(args[2]))))
        return
    parser = argparse.ArgumentParser(prog="python -m bench.tracker")
    parser.add_argument("--baseline", default="main")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--entries", type=int, default=200_000)
    parser.add_argument("--ingest", action="store_true")
    options = parser.parse_args(args)
    report: dict[str, Any] = {
        "baseline": options.baseline,
        "runs": options.runs,
        "entries": options.entries,
    }
    with tempfile.TemporaryDirectory() as tmp:
        base = _export(options.baseline, Path(tmp))
        here, there = [], []
        for _ in range(options.runs):
            here.append(_run(ROOT, options.entries)["us_per_entry"])
            there.append(_run(base, options.entries)["us_per_entry"])
        report.update(_compare("tracker_per_entry", here, there))
        if options.ingest:
            from bench.generate import journal_for

            journal = journal_for(200_000, log=False).directory
            here, there = [], []
            for _ in range(options.runs):
                here.append(_ingest(ROOT, journal))
                there.append(_ingest(base, journal))
            report.update(_compare("ingest_per_unit_entry", here, there))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
