"""One measured run on a saved journal in a fresh interpreter: `bench.scale`'s worker.

`python -m bench.scale_worker daemon SPEC.json` runs `supervisor.app.run_daemon` (systemd and
metrics off, state in a temporary directory, the journal directory read from its head, as after
downtime) until `expect` invocations were decided and the reader child has answered a sync
request (the whole journal read and handed over), then prints one JSON object:
- `first_s`, `last_s`: seconds from the daemon's start to its first and last decision;
- `caught_up_s`: to the sync answer (everything in the journal read);
- `decided`, `units_decided`, `reader_restarts`;
- `rss_anon_mb`, `rss_mb`, `hwm_mb` (the daemon's RssAnon, VmRSS, VmHWM once caught up),
  `child_anon_mb`, `child_rss_mb` (its reader child's RssAnon, and VmRSS with the journal files
  it maps);
- `cpu_s`: the daemon's and its children's CPU seconds over the run.

`python -m bench.scale_worker child SPEC.json` runs the native reader child alone as the daemon
starts it (following from the journal's head, the units' filter on) until it answers a sync
request asked at its start: `caught_up_s` and its `cpu_s`, output read and thrown away.

`python -m bench.scale_worker tracker SPEC.json`: the tracker alone, CPU microseconds per line
fed (`us_per_line`) for `lines` lines of `size` bytes over 8 units.

`python -m bench.scale_worker python_systemd SPEC.json`: the peer, python-systemd's Reader, reads
the journal through the units' matches to its end (`measure_python_systemd`).

`python -m bench.scale_worker table SPEC.json`: a signature table's load, validation and a
crash's classification, apart (`measure_table`; SPEC {"table": DIR}).

SPEC: {"journal": DIR, "units": [...], "expect": N, "reader": "auto"|"journalctl",
"timeout_s": S, "lines": N, "size": B}. With PYTHONPATH naming another checkout's package, that
checkout is measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


async def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the daemon on the spec's journal until its crashes are decided and it caught up."""
    from vllm_supervisor import app
    from vllm_supervisor.config import (
        Config,
        JournalConfig,
        MetricsConfig,
        StateConfig,
        SystemdConfig,
        UnitConfig,
    )
    from vllm_supervisor.daemon import Daemon
    from vllm_supervisor.loop.acting import Acting, Job

    decisions: list[tuple[float, str | None]] = []
    decided_all = asyncio.Event()
    if spec["expect"] <= 0:
        decided_all.set()
    built: list[Daemon] = []
    was_built = asyncio.Event()
    init, carry_out = Daemon.__init__, Acting.carry_out

    # The harness times the real daemon from outside: the class is patched in this process only.
    def noting_init(self: Daemon, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        built.append(self)
        was_built.set()

    async def committing(self: Acting, unit: str, jobs: list[Job]) -> None:
        # Every decided outcome is acted on and committed as taken here, in its unit's lane.
        await carry_out(self, unit, jobs)
        now = time.monotonic()
        decisions.extend((now, unit) for j in jobs if _failed(j))
        if len(decisions) >= spec["expect"]:
            decided_all.set()

    Daemon.__init__ = noting_init  # type: ignore[method-assign]
    Acting.carry_out = committing  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory(prefix="vllm-supervisor-scale-") as tmp:
        root = Path(tmp)
        config = Config(
            units=tuple(UnitConfig(name=unit) for unit in spec["units"]),
            journal=JournalConfig(
                directory=Path(spec["journal"]), start_at="head", reader=spec["reader"]
            ),
            state=StateConfig(state_dir=root / "state", runtime_dir=root / "run"),
            metrics=MetricsConfig(enabled=False),
            systemd=SystemdConfig(enabled=False),
        )
        last = _last_cursor(spec["journal"])
        stop = asyncio.Event()
        cpu0 = _cpu_s()
        started = time.monotonic()
        task = asyncio.create_task(app.run_daemon(config, stop, asyncio.Event()))
        await was_built.wait()
        daemon = built[0]
        deadline = started + spec["timeout_s"]
        caught_up = await _caught_up(daemon, deadline, last)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(decided_all.wait(), max(0.0, deadline - time.monotonic()))
        status = _status()
        process = daemon.reader._process  # its reader child, if one runs
        child = _status(process.pid) if process is not None else {}
        restarts = daemon.reader.restarts
        stop.set()
        await task
        cpu = _cpu_s() - cpu0
    return {
        "decided": len(decisions),
        "units_decided": sorted({unit for _, unit in decisions if unit}),
        "first_s": decisions[0][0] - started if decisions else None,
        "last_s": decisions[-1][0] - started if decisions else None,
        "caught_up_s": caught_up - started if caught_up is not None else None,
        "reader_restarts": restarts,
        "rss_anon_mb": status.get("RssAnon", 0) / 1024,
        "rss_mb": status.get("VmRSS", 0) / 1024,
        "hwm_mb": status.get("VmHWM", 0) / 1024,
        "child_rss_mb": child.get("VmRSS", 0) / 1024,  # with the journal files it maps
        "child_anon_mb": child.get("RssAnon", 0) / 1024,
        "cpu_s": cpu,
    }


def _failed(job: Any) -> bool:
    """Was this job's invocation a failed one? The outcome as recorded (`Job.recorded`); a
    checkout from before it carried the outcome itself (`Job.outcome`)."""
    recorded = getattr(job, "recorded", None)
    if recorded is not None:
        return recorded.done() and bool(recorded.result().invocation.failed)
    return bool(job.outcome.invocation.failed)


async def _caught_up(daemon: Any, deadline: float, last: str | None) -> float | None:
    """When the reader child answered a sync request (the journal read to its end), or None.
    The journalctl child takes no requests: then when the reader's checkpoint reached `last`,
    the journal's last entry (polled: 50 ms at most late)."""
    while time.monotonic() < deadline:
        if not daemon.reader.can_sync:
            if last is None or daemon.reader.cursor == last:
                return time.monotonic()
        elif daemon.reader.following.is_set() and await daemon.reader.sync(
            max(0.1, deadline - time.monotonic())
        ):
            return time.monotonic()
        await asyncio.sleep(0.05)  # no child yet (restarting): look again, with a deadline
    return None


def _last_cursor(directory: str) -> str | None:
    """The cursor of the journal's last entry (journalctl, before the clock starts)."""
    out = subprocess.run(
        ["journalctl", f"--directory={directory}", "--lines=1", "--output=export",
         "--output-fields=MESSAGE_ID", "--no-pager", "--quiet"],
        capture_output=True,
        check=True,
    ).stdout  # fmt: skip
    for line in out.splitlines():
        if line.startswith(b"__CURSOR="):
            return line.split(b"=", 1)[1].decode()
    return None


def _status(pid: int | str = "self") -> dict[str, int]:
    """A process's memory from /proc/PID/status, in kB (empty once it is gone)."""
    fields: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return fields
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if value.strip().endswith(" kB"):
            fields[name] = int(value.split()[0])
    return fields


def _cpu_s() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def measure_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The native child alone, following from the head, until it answered sync request 1."""
    from vllm_supervisor.journal import reader

    settings = reader.ReaderSettings(
        units=tuple(spec["units"]),
        directory=Path(spec["journal"]),
        start_at="head",
        source="native",
    )
    argv = reader.native_argv(settings, None)
    native_input = getattr(reader, "native_input", None)  # absent before units went to stdin
    first = native_input(settings) if native_input is not None else b""
    kids0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(first + b"1\n")
    child.stdin.flush()
    tail = b"\n"  # so that a first row "#1" is found too
    caught_up = None
    while chunk := child.stdout.read1(1 << 20):
        tail = (tail + chunk)[-64:]
        if b"\n#1\n" in tail:
            caught_up = time.monotonic() - started
            break
    child.kill()
    child.wait()
    kids1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = kids1.ru_utime + kids1.ru_stime - kids0.ru_utime - kids0.ru_stime
    return {"caught_up_s": caught_up, "cpu_s": cpu}


def measure_tracker(spec: dict[str, Any]) -> dict[str, Any]:
    """CPU per line through `InvocationTracker.feed`: `lines` lines of `size` bytes (every 20th
    an error line) spread over 8 units' open runs, the entries built before the clock starts.
    Each unit gets far more lines than its head and tail hold, as in a long run."""
    from vllm_supervisor.model import JournalEntry
    from vllm_supervisor.track.tracker import InvocationTracker

    size, count = spec["size"], spec["lines"]
    # Messages come from a pool of 2,000 (the text of 16,000 lines of 64 KiB would not fit).
    pool = [
        (f"{'ERROR' if n % 20 == 0 else 'INFO'} request {n}: " + "x" * size)[:size]
        for n in range(min(count, 2000))
    ]
    entries = [
        JournalEntry(
            cursor=f"c{n}",
            realtime_us=1_700_000_000_000_000 + n,
            message=pool[n % len(pool)],
            unit=f"serve-{n % 8}.service",
            invocation_id=f"{n % 8:032x}",
            pid=3000 + n % 8,
            priority=6,
        )
        for n in range(count)
    ]
    tracker = InvocationTracker()
    started = time.process_time()
    for entry in entries:
        tracker.feed(entry)
    cpu = time.process_time() - started
    return {"us_per_line": cpu / count * 1e6, "cpu_s": cpu}


PEER_KEEP = 400  # messages a peer remembers per unit (bench.peers.KEEP)
PEER_MATCH_UNITS_MAX = 64  # past this many, the peer filters in Python (as our reader does)


def measure_python_systemd(spec: dict[str, Any]) -> dict[str, Any]:
    """python-systemd's `Reader` reading the journal from its head to its end, with the units'
    three fields as matches (what `journalctl -u` matches; past PEER_MATCH_UNITS_MAX units on
    each entry's fields instead), every field decoded, the last PEER_KEEP messages of each unit
    kept: `caught_up_s`, `cpu_s`, `entries` and its `rss_anon_mb` at the end."""
    from collections import deque

    from systemd import journal

    units = list(spec["units"])
    fields = ("_SYSTEMD_UNIT", "UNIT", "OBJECT_SYSTEMD_UNIT")
    cpu0 = _cpu_s()
    started = time.monotonic()
    reader = journal.Reader(path=spec["journal"])
    wanted = frozenset(units)
    by_match = len(units) <= PEER_MATCH_UNITS_MAX
    if by_match:
        for index, name in enumerate(fields):
            if index:
                reader.add_disjunction()
            for unit in units:
                reader.add_match(**{name: unit})
    reader.seek_head()
    kept: dict[str, deque[object]] = {}
    entries = 0
    for entry in reader:
        unit = next((entry[f] for f in fields if entry.get(f) in wanted), None)
        if unit is None:
            continue
        entries += 1
        kept.setdefault(unit, deque(maxlen=PEER_KEEP)).append(entry.get("MESSAGE"))
    caught_up = time.monotonic() - started
    status = _status()
    return {
        "caught_up_s": caught_up,
        "cpu_s": _cpu_s() - cpu0,
        "entries": entries,
        "rss_anon_mb": status.get("RssAnon", 0) / 1024,
        "hwm_mb": status.get("VmHWM", 0) / 1024,
    }


def measure_table(spec: dict[str, Any]) -> dict[str, Any]:
    """A signature table directory: `validate_s` (every file parsed and checked, as loading
    does), `load_s` (the whole load: validated, built, its sets compiled), `cached_load_s` (the
    same files loaded again through the table cache, the table loaded before freed first; None
    for a checkout without it), the seed crash's classification the first time
    (`classify_first_ms`: what the table builds lazily, sets' automata or regexes, is built
    then) and after (`classify_ms`, median of 5), CPU time each, and the table's size.

    And the floor of any load that reads and validates every pattern: `toml_s` (the files
    parsed by tomllib alone, nothing checked) and `re2_sets_s` (RE2 alone compiling every
    pattern into sets of 256, the budget check; C++ throughout)."""
    import gc
    import inspect
    import statistics
    import tomllib

    from bench.generate import seed_lines
    from vllm_supervisor.classify import signatures
    from vllm_supervisor.classify.classifier import Classifier
    from vllm_supervisor.classify.schema import parse_table_file
    from vllm_supervisor.journal.saved import plain_text_invocation

    directory = Path(spec["table"])
    check = getattr(signatures, "check_pattern", signatures.compile_pattern)
    files = sorted(directory.glob("*.toml"))
    started = time.process_time()
    for path in files:
        parse_table_file(path, check)
    validate = time.process_time() - started
    started = time.process_time()
    documents = [tomllib.loads(path.read_text(encoding="utf-8")) for path in files]
    toml = time.process_time() - started
    patterns = [
        pattern
        for document in documents
        for entry in document.get("signature", [])
        for pattern in entry.get("patterns", [])
    ]
    started = time.process_time()
    _re2_sets(patterns)
    re2_sets = time.process_time() - started
    started = time.process_time()
    table = signatures.load_signature_table([directory])
    load = time.process_time() - started
    cached_load = None
    if "cache_dir" in inspect.signature(signatures.load_signature_table).parameters:
        # As the daemon's next start or reload of the same files: read back from the cache.
        with tempfile.TemporaryDirectory(prefix="vllm-supervisor-table-") as cache:
            signatures.load_signature_table([directory], cache_dir=Path(cache))
            # Freed before, not inside, the measured load: freeing the table parsed above
            # took ~5 ms of a 5,000-signature table's ~11 ms cached load.
            del table
            gc.collect()
            started = time.process_time()
            table = signatures.load_signature_table([directory], cache_dir=Path(cache))
            cached_load = time.process_time() - started
    classifier = Classifier(table)
    lines = plain_text_invocation(seed_lines()).lines
    started = time.process_time()
    verdict = classifier.classify(lines)
    first = time.process_time() - started
    again = []
    for _ in range(5):
        started = time.process_time()
        classifier.classify(lines)
        again.append(time.process_time() - started)
    return {
        "signatures": len(table),
        "validate_s": validate,
        "toml_s": toml,
        "re2_sets_s": re2_sets,
        "patterns": len(patterns),
        "load_s": load,
        "cached_load_s": cached_load,
        "classify_first_ms": first * 1e3,
        "classify_ms": statistics.median(again) * 1e3,
        "signature": verdict.signature,
        "rss_anon_mb": _status().get("RssAnon", 0) / 1024,
    }


def _re2_sets(patterns: list[str], size: int = 256) -> None:
    """Compile `patterns` into RE2 sets of `size`, each with 64 KiB of budget a pattern."""
    import re2

    for start in range(0, len(patterns), size):
        options = re2.Options()
        options.log_errors = False
        options.max_mem = max(8 << 20, size * (64 << 10))
        rset = re2.Set.SearchSet(options)
        for pattern in patterns[start : start + size]:
            rset.Add(pattern)
        rset.Compile()


def main(argv: list[str]) -> int:
    """`python -m bench.scale_worker daemon|child|tracker|python_systemd|table SPEC.json`: one
    run, one JSON line."""
    mode, spec = argv[0], json.loads(Path(argv[1]).read_text())
    if mode == "daemon":
        result = asyncio.run(measure(spec))
    elif mode == "child":
        result = measure_child(spec)
    elif mode == "python_systemd":
        result = measure_python_systemd(spec)
    elif mode == "table":
        result = measure_table(spec)
    else:
        result = measure_tracker(spec)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
