"""Follow-mode figures: the real `Daemon` following a journal that journal-remote writes live.

The parent writes vLLM lines at a fixed rate through systemd-journal-remote, each stamped with its
wall-clock write time as `__REALTIME_TIMESTAMP`, and every few seconds a crash (the seed traceback,
PID 1's exit, failure and restart messages, then a new start). The follower is a separate process
(`python -m bench.live ROOT`) running `supervisor.daemon.Daemon` as `app.run_daemon` builds it
(store, metrics, halter with systemd disabled, journalctl following `ROOT/journal`), with
`handle_batch` wrapped to note when each entry was handled. Figures:
- lag: time handled - `__REALTIME_TIMESTAMP` of each entry (written -> handled), p50/p99;
- crash latency: decision made - timestamp of the entry that ended the invocation (PID 1's
  "Failed with result", written right after "Main process exited"), p50/p99;
- CPU %: the follower's CPU plus its journalctl child's over the window, / wall time.
"""

from __future__ import annotations

import asyncio
import json
import resource
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench.generate import UNIT, Encoder, finish_remote, seed_lines, start_remote, stdout_fields
from vllm_supervisor.journal.writer import crashed_invocation, lifecycle
from vllm_supervisor.model import LifecycleEvent

CRASH_EVERY_S = 1.5
DRAIN_S = 1.5


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure_live(rate: int, seconds: float) -> dict[str, Any]:
    """Write `rate` lines/s for `seconds` while the daemon follows; its lag, latency and CPU."""
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
        follower = subprocess.Popen(
            [sys.executable, "-m", "bench.live", str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=Path(__file__).resolve().parent.parent,
        )
        try:
            assert follower.stdout is not None
            # structlog writes its events to stdout too: read up to our marker.
            while (line := follower.stdout.readline()) and line.strip() != b"ready":
                pass
            if not line:
                follower.kill()
                _, errors = follower.communicate(timeout=30)
                raise SystemExit(f"live follower did not start: {errors.decode()[-2000:]}")
            written, crashes = _write_at_rate(remote, encoder, inv, rate, seconds)
            time.sleep(DRAIN_S)
        finally:
            follower.send_signal(signal.SIGTERM)
            out, _ = follower.communicate(timeout=60)
            finish_remote(remote)
    result = json.loads(out.decode().strip().splitlines()[-1])
    lags = result.pop("lags_ms")
    crash_ms = result.pop("crash_ms")
    return {
        "rate": rate,
        "seconds": seconds,
        "written": written,
        "achieved_rate": written / seconds,
        "crashes_written": crashes,
        "crashes_decided": len(crash_ms),
        "lag_ms_p50": _percentile(lags, 0.5),
        "lag_ms_p99": _percentile(lags, 0.99),
        "lag_ms_max": max(lags, default=0.0),
        "crash_ms_p50": _percentile(crash_ms, 0.5),
        "crash_ms_p99": _percentile(crash_ms, 0.99),
        **result,
    }


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
            written += 1
        remote.stdin.write(b"".join(chunk))
        remote.stdin.flush()
        pause = start + tick * (1 + (now - start) // tick) - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # pacing the writer
    return written, crashes


async def _follow(root: Path) -> dict[str, Any]:
    """The follower process: the real Daemon, timed per batch."""
    from vllm_supervisor.actions.actor import Actor
    from vllm_supervisor.actions.halt import Halter
    from vllm_supervisor.actions.quarantine import Quarantine, quarantine_dir
    from vllm_supervisor.classify.table import load_table
    from vllm_supervisor.config import (
        Config,
        JournalConfig,
        MetricsConfig,
        StateConfig,
        SystemdConfig,
        UnitConfig,
    )
    from vllm_supervisor.daemon import Daemon
    from vllm_supervisor.model import JournalEntry, Outcome
    from vllm_supervisor.store import Store
    from vllm_supervisor.telemetry.metrics import Metrics

    config = Config(
        units=(UnitConfig(name=UNIT),),
        journal=JournalConfig(directory=root / "journal", start_at="head"),
        state=StateConfig(state_dir=root / "state", runtime_dir=root / "run"),
        metrics=MetricsConfig(enabled=False),
        systemd=SystemdConfig(enabled=False),
    )
    lags: list[float] = []
    crash_ms: list[float] = []

    class TimedDaemon(Daemon):
        async def handle_batch(self, batch: list[JournalEntry]) -> list[Outcome]:
            outcomes = await super().handle_batch(batch)
            now = time.time()
            lags.extend((now - e.realtime_us / 1e6) * 1000 for e in batch)
            crash_ms.extend(
                (now - (o.invocation.ended_us or 0) / 1e6) * 1000
                for o in outcomes
                if o.invocation.failed
            )
            return outcomes

    store = Store.in_directory(config.state.state_dir)
    halter = Halter(Quarantine(quarantine_dir(config)), None, attempts=1, timeout_s=1.0)
    metrics = Metrics()
    actor = Actor(halter, None, metrics)
    daemon = TimedDaemon(config, load_table(config), store=store, metrics=metrics, actor=actor)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    task = asyncio.create_task(daemon.run(stop))
    await daemon.reader.following.wait()
    cpu0 = _cpu()
    wall0 = time.monotonic()
    print("ready", flush=True)
    await task
    wall = time.monotonic() - wall0
    cpu = _cpu() - cpu0  # journalctl is reaped by now: its CPU is in RUSAGE_CHILDREN
    store.close()
    return {
        "handled": len(lags),
        "cpu_percent": 100 * cpu / wall,
        "cpu_s": cpu,
        "window_s": wall,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "lags_ms": lags,
        "crash_ms": crash_ms,
    }


def _cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def main(argv: list[str]) -> int:
    """`python -m bench.live ROOT`: follow ROOT/journal until SIGTERM, print the figures."""
    result = asyncio.run(_follow(Path(argv[0])))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
