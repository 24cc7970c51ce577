"""Follow-mode figures: the real `Daemon` following a journal that journal-remote writes live.

The parent writes vLLM lines at a fixed rate through systemd-journal-remote, each stamped with its
wall-clock write time as `__REALTIME_TIMESTAMP`, and every few seconds a crash (the seed traceback,
PID 1's exit, failure and restart messages, then a new start). The follower is a separate process
(`python -m bench.live ROOT`) running `supervisor.daemon.Daemon` as `app.run_daemon` builds it
(store, metrics, halter with systemd disabled, journalctl following `ROOT/journal`), with
its batch handling wrapped to note when each entry was handled. Figures:
- lag: time handled - `__REALTIME_TIMESTAMP` of each entry (written -> handled), p50/p99;
- crash latency: decision acted on and committed - timestamp of the entry that ended the
  invocation (PID 1's "Failed with result", written right after "Main process exited"),
  p50/p99;
- CPU %: the follower's CPU (every thread) plus its reader child's, from `ready` to SIGTERM,
  / wall time. Each process's start and exit lie outside that window, for every follower
  alike: the figure is the cost of following, not of an interpreter starting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.generate import UNIT, Encoder, finish_remote, seed_lines, start_remote, stdout_fields
from vllm_supervisor.journal.writer import crashed_invocation, lifecycle
from vllm_supervisor.model import LifecycleEvent

SUPERVISOR = "supervisor"
CRASH_EVERY_S = 1.5
# vLLM says it is serving before it logs requests: the first line of every invocation here.
READY_LINE = b"(APIServer pid=5000) INFO:     Application startup complete."
DRAIN_S = 1.5


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure_live(rate: int, seconds: float, follower: str = SUPERVISOR) -> dict[str, Any]:
    """Write `rate` lines/s for `seconds` while `follower` follows; its lag, latency and CPU."""
    with _following(follower) as run:
        written, crashes = _write_at_rate(run.remote, run.encoder, run.invocation_id, rate, seconds)
        time.sleep(DRAIN_S)
    out = run.output
    result = json.loads(out.decode().strip().splitlines()[-1])
    lags = result.pop("lags_ms")
    crash_ms = result.pop("crash_ms")
    return {
        "follower": follower,
        "rate": rate,
        "seconds": seconds,
        "written": written,
        "achieved_rate": written / seconds,
        "crashes_written": crashes,
        "crashes_decided": len(crash_ms),
        "lag_ms_p50": percentile(lags, 0.5),
        "lag_ms_p99": percentile(lags, 0.99),
        "lag_ms_max": max(lags, default=0.0),
        "crash_ms_p50": percentile(crash_ms, 0.5),
        "crash_ms_p99": percentile(crash_ms, 0.99),
        **result,
    }


def measure_idle(seconds: float, follower: str = SUPERVISOR) -> dict[str, Any]:
    """`follower` on a journal nobody writes to: its wake-ups per second and its memory.

    Wake-ups are context switches (voluntary + involuntary, every thread) of the follower and
    of its children over `seconds`, counted after a settling second; memory is VmRSS and
    RssAnon of the follower (and, apart, of its reader child) at the end."""
    with _following(follower) as run:
        pid = run.process.pid
        # The start's own work ends: imports, the tail, the first read, its checkpoint.
        time.sleep(3.0)
        before = _switches(pid)
        time.sleep(seconds)  # the idle window being measured
        after = _switches(pid)
        memory = {key: status_kb(pid, key) for key in ("VmRSS", "RssAnon")}
        child_rss = sum(status_kb(child, "VmRSS") for child in children_of(pid))
    return {
        "follower": follower,
        "seconds": seconds,
        "wakeups_per_s": (after - before) / seconds,
        "rss_mb": memory["VmRSS"] / 1024,
        "rss_anon_mb": memory["RssAnon"] / 1024,
        "child_rss_mb": child_rss / 1024,
    }


@dataclass
class _Run:
    remote: subprocess.Popen[bytes]  # journal-remote, writing the journal
    encoder: Encoder
    invocation_id: str  # the invocation started so far
    process: subprocess.Popen[bytes]  # the follower
    output: bytes = b""  # its stdout, once it was stopped


@contextlib.contextmanager
def _following(follower: str) -> Iterator[_Run]:
    """A journal journal-remote writes (one start so far), `follower` following it and ready;
    at the end the follower gets SIGTERM and its output is kept in `output`."""
    with tempfile.TemporaryDirectory(prefix="vllm-supervisor-live-") as tmp:
        root = Path(tmp)
        remote = start_remote(root / "journal")
        assert remote.stdin is not None
        encoder = Encoder(start_us=_now_us(), step_us=1)
        inv = uuid.uuid4().hex
        started = lifecycle(UNIT, inv, LifecycleEvent.JOB_STARTED, f"Started {UNIT}.")
        remote.stdin.write(encoder.entry(started, now_us=_now_us()))
        remote.stdin.flush()
        _wait_for_file(root / "journal")
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.live", str(root), follower],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=Path(__file__).resolve().parent.parent,
        )
        run = _Run(remote, encoder, inv, process)
        try:
            assert process.stdout is not None
            # structlog writes its events to stdout too: read up to our marker.
            while (line := process.stdout.readline()) and line.strip() != b"ready":
                pass
            if not line:
                process.kill()
                _, errors = process.communicate(timeout=30)
                raise SystemExit(f"live follower did not start: {errors.decode()[-2000:]}")
            yield run
        finally:
            process.send_signal(signal.SIGTERM)
            run.output, _ = process.communicate(timeout=60)
            finish_remote(remote)


def children_of(pid: int) -> list[int]:
    """The children of every thread of `pid` (a peer's journalctl is its thread's child)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


def _switches(pid: int) -> int:
    """Context switches of every thread of `pid` and of its children (their wake-ups)."""
    total = 0
    for process in (pid, *children_of(pid)):
        for task in Path(f"/proc/{process}/task").glob("*"):
            try:
                status = (task / "status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    total += int(line.split()[1])
    return total


def status_kb(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _now_us() -> int:
    return int(time.time() * 1e6)


def _wait_for_file(directory: Path) -> None:
    deadline = time.monotonic() + 10
    while not any(directory.glob("*.journal")):
        if time.monotonic() > deadline:
            raise SystemExit("journal-remote wrote no file")
        time.sleep(0.01)  # polling for a file another process creates, with a deadline


def _write_at_rate(
    remote: subprocess.Popen[bytes], encoder: Encoder, inv: str, rate: int, seconds: float
) -> tuple[int, int]:
    """Lines at `rate`/s in 10 ms ticks, a crash every CRASH_EVERY_S; (entries, crashes)."""
    assert remote.stdin is not None
    tick = 0.01
    per_tick = max(1, round(rate * tick))
    seed = seed_lines()
    written = crashes = 0
    pid = 5000
    constant = stdout_fields(UNIT, inv, pid, comm="python3", cmdline="python3 -m vllm")
    remote.stdin.write(encoder.line(constant, READY_LINE, now_us=_now_us()))
    written += 1
    start = time.monotonic()
    next_crash = start + CRASH_EVERY_S
    n = 0
    while (now := time.monotonic()) < start + seconds:
        chunk = []
        stamp = time.strftime("%m-%d %H:%M:%S")
        for _ in range(per_tick):
            n += 1
            message = (
                f"(APIServer pid={pid}) INFO {stamp} [logger.py:43] Received request "
                f"chatcmpl-{n:032x}: prompt: 'summarize this document', params: "
                "SamplingParams(n=1, temperature=0.7, max_tokens=512), lora_request: None."
            )
            chunk.append(encoder.line(constant, message.encode(), now_us=_now_us()))
        written += len(chunk)
        if now >= next_crash:
            next_crash += CRASH_EVERY_S
            crashes += 1
            for fields in crashed_invocation(UNIT, seed, invocation_id=inv, restarts=crashes)[1:]:
                chunk.append(encoder.entry(fields, now_us=_now_us()))
                written += 1
            inv, pid = uuid.uuid4().hex, pid + 1
            constant = stdout_fields(UNIT, inv, pid, comm="python3", cmdline="python3 -m vllm")
            restarted = lifecycle(UNIT, inv, LifecycleEvent.JOB_STARTED, f"Started {UNIT}.")
            chunk.append(encoder.entry(restarted, now_us=_now_us()))
            chunk.append(encoder.line(constant, READY_LINE, now_us=_now_us()))
            written += 2
        remote.stdin.write(b"".join(chunk))
        remote.stdin.flush()
        pause = start + tick * (1 + (now - start) // tick) - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # pacing the writer
    return written, crashes


async def _follow(root: Path) -> dict[str, Any]:
    """The follower process: the daemon as `app.run_daemon` builds it, timed per batch."""
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
    from vllm_supervisor.model import JournalEntry, Outcome
    from vllm_supervisor.telemetry.metrics import Metrics

    config = Config(
        units=(UnitConfig(name=UNIT),),
        # BENCH_LIVE_KERNEL=0: without the kernel's Xid child (bench.kernel_cost's baseline).
        journal=JournalConfig(
            directory=root / "journal",
            start_at="head",
            kernel=os.environ.get("BENCH_LIVE_KERNEL", "1") != "0",
        ),
        state=StateConfig(state_dir=root / "state", runtime_dir=root / "run"),
        metrics=MetricsConfig(enabled=False),
        systemd=SystemdConfig(enabled=False),
    )
    lags: list[float] = []
    crash_ms: list[float] = []
    built: list[Daemon] = []
    was_built = asyncio.Event()
    batches: list[int] = []  # entries per handled batch
    loop_lags: list[float] = []  # the daemon's own event-loop lag samples (ms)
    handle = Daemon._handle
    init = Daemon.__init__

    # The harness times the real daemon from outside: the class is patched in this process only.
    def noting_init(self: Daemon, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        built.append(self)
        was_built.set()

    async def timed(self: Daemon, batch: list[JournalEntry]) -> list[asyncio.Future[Outcome]]:
        outcomes = await handle(self, batch)
        now = time.time()
        batches.append(len(batch))
        lags.extend((now - e.realtime_us / 1e6) * 1000 for e in batch)
        return outcomes

    async def committing(self: Acting, unit: str, jobs: list[Job]) -> None:
        # Decided in a batch or by the settle loop, every outcome is acted on and committed
        # as taken here, in its unit's lane.
        await carry_out(self, unit, jobs)
        now = time.time()
        crash_ms.extend(
            (now - (j.outcome.invocation.ended_us or 0) / 1e6) * 1000
            for j in jobs
            if j.outcome.invocation.failed
        )

    def lagging(self: Metrics, seconds: float) -> None:
        loop_lag(self, seconds)
        loop_lags.append(seconds * 1000)

    carry_out = Acting.carry_out
    loop_lag = Metrics.loop_lag
    Metrics.loop_lag = lagging  # type: ignore[method-assign]
    Daemon.__init__ = noting_init  # type: ignore[method-assign]
    Daemon._handle = timed  # type: ignore[method-assign]
    Acting.carry_out = committing  # type: ignore[method-assign]
    stop = asyncio.Event()
    window = _Window()

    def stopping() -> None:
        window.end()
        stop.set()

    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stopping)
    task = asyncio.create_task(app.run_daemon(config, stop, asyncio.Event()))
    await was_built.wait()
    await built[0].reader.following.wait()
    # The reader child is spawned, not yet reading: its start and its first pass over the
    # journal are not following. Its answer to a sync request comes after that pass.
    if not await built[0].reader.sync(30.0):
        raise SystemExit("the reader child answered no sync request")
    window.begin()
    print("ready", flush=True)
    await task
    return {
        "handled": len(lags),
        "batches": len(batches),
        **window.figures(),
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "lags_ms": lags,
        "crash_ms": crash_ms,
        "loop_lag_ms_p50": percentile(loop_lags, 0.5),
        "loop_lag_ms_p99": percentile(loop_lags, 0.99),
        "loop_lag_ms_max": max(loop_lags, default=0.0),
        "loop_lag_samples": len(loop_lags),
    }


def _follow_peer(root: Path, name: str) -> dict[str, Any]:
    """The follower process for a peer: its loop in a thread until SIGTERM, then its CPU.

    The bindings block in C (`wait()`), where no Python signal handler runs: the main thread
    waits for the signal instead, and the process exits without joining the loop."""
    from bench.peers import PEERS, Tally

    follow = PEERS[name][0]
    tally = Tally()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # the thread inherits the mask
    window = _Window()
    errors: list[str] = []

    def run() -> None:
        try:
            follow(root / "journal", UNIT, tally)
        except Exception as exc:  # reported in the figures, not lost in a thread
            errors.append(f"{type(exc).__name__}: {exc}")

    threading.Thread(target=run, daemon=True).start()
    if not tally.ready.wait(30.0) and not errors:
        raise SystemExit(f"{name} did not open the journal")
    window.begin()
    print("ready", flush=True)
    signal.sigwait({signal.SIGTERM})
    window.end()
    if tally.child is not None:
        tally.child.kill()  # it inherited the blocked SIGTERM
        tally.child.wait()
    return {
        "handled": tally.handled,
        "errors": errors,
        **window.figures(),
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "lags_ms": [],
        "crash_ms": [],
    }


class _Window:
    """The follower's CPU between `begin` and `end`: its own (every thread, from getrusage) and
    its live children's (their threads' on-CPU nanoseconds in /proc schedstat). Neither
    process's start or exit falls inside, whichever follower it is."""

    def __init__(self) -> None:
        self._start = self._stop = (0.0, 0.0, 0.0)

    def begin(self) -> None:
        self._start = self._stop = self._sample()

    def end(self) -> None:
        self._stop = self._sample()

    def figures(self) -> dict[str, float]:
        wall = self._stop[0] - self._start[0]
        own = self._stop[1] - self._start[1]
        child = self._stop[2] - self._start[2]
        return {
            "cpu_percent": 100 * (own + child) / wall if wall > 0 else 0.0,
            "cpu_child_percent": 100 * child / wall if wall > 0 else 0.0,
            "cpu_s": own + child,
            "window_s": wall,
        }

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        me = resource.getrusage(resource.RUSAGE_SELF)
        children = sum(_on_cpu_s(child) for child in children_of(os.getpid()))
        return time.monotonic(), me.ru_utime + me.ru_stime, children


def _on_cpu_s(pid: int) -> float:
    """Seconds on a CPU of every thread of `pid` (0 once it is gone)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def main(argv: list[str]) -> int:
    """`python -m bench.live ROOT [FOLLOWER]`: follow ROOT/journal until SIGTERM, print the
    figures; FOLLOWER is `supervisor` (the default) or a peer of `bench.peers`."""
    root, follower = Path(argv[0]), argv[1] if len(argv) > 1 else SUPERVISOR
    if follower == SUPERVISOR:
        profile = os.environ.get("BENCH_LIVE_PROFILE")  # a path: cProfile the follower into it
        if profile:
            import cProfile

            with cProfile.Profile() as profiler:
                result = asyncio.run(_follow(root))
            profiler.dump_stats(profile)
        else:
            result = asyncio.run(_follow(root))
    else:
        result = _follow_peer(root, follower)
    print(json.dumps(result), flush=True)
    if follower != SUPERVISOR:
        os._exit(0)  # the peer's thread still blocks in its binding
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
