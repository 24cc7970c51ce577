"""Nothing blocks the event loop: the lag probe sees a blocking call; a slow commit is none."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from pathlib import Path

from conftest import poll

from vllm_supervisor.app import compose_daemon
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.demo import DEMO_UNIT, demo_config, seed_lines
from vllm_supervisor.journal.writer import JournalWriter, crashed_invocation
from vllm_supervisor.store import Store
from vllm_supervisor.telemetry import looplag
from vllm_supervisor.telemetry.looplag import LoopLag
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

SLOW_COMMIT_S = 1.0
# On the loop, the commit would show as a lag of about its whole duration (a ratio near 1).
MAX_LAG_RATIO = 0.5


class TestLoopLag:
    async def test_a_blocking_call_shows_as_lag_and_idle_samples_nothing(self) -> None:
        """A call that holds the loop 200 ms shows as one sample of at least 200 ms less one
        interval; a second after the last poke the probe stops: an idle daemon has no timer."""
        samples: list[float] = []
        lag = LoopLag(samples.append)
        lag.poke()
        await poll(lambda: len(samples) >= 2, within=5)
        time.sleep(0.2)  # noqa: ASYNC251 - the blocking call under test, on the loop on purpose
        await poll(lambda: max(samples) >= 0.2 - looplag.INTERVAL_S - 0.01, within=5)
        await poll(lambda: not lag.sampling, within=looplag.BUSY_FOR_S + 5)
        count = len(samples)
        await asyncio.sleep(3 * looplag.INTERVAL_S)  # a span in which an idle probe would tick
        assert len(samples) == count


async def test_a_slow_commit_does_not_stall_the_loop(tmp_path: Path) -> None:
    """A state commit that takes a second (a slow disk's fsync) runs in the writer's thread, not
    on the loop: the loop's worst lag while the crash is recorded stays a small fraction of it.

    The thread is the property; the lag is a ratio against the commit's own duration, so CPU
    contention from other processes (which delays the loop by tens of milliseconds, and once
    by 196 ms under a full suite run) cannot pass for a commit on the loop (a ratio near 1).
    """
    config = demo_config(tmp_path)
    store = Store.in_directory(config.state.state_dir)
    slow: list[float] = []
    commit_threads: set[int] = set()

    def slow_disk(statement: str) -> None:
        if statement.strip().upper() != "COMMIT":
            return
        commit_threads.add(threading.get_ident())
        started = time.monotonic()
        time.sleep(SLOW_COMMIT_S)  # the slow fsync being simulated, in the commit's thread
        slow.append(time.monotonic() - started)

    assert store.writer is not None
    store.writer.connection.set_trace_callback(slow_disk)
    metrics = Metrics(new_registry(process=False))
    samples: list[float] = []
    record = metrics.loop_lag

    def noting(seconds: float) -> None:
        samples.append(seconds)
        record(seconds)

    metrics.loop_lag = noting  # type: ignore[method-assign]
    daemon = compose_daemon(config, load_table(config), store=store, metrics=metrics)
    crash = crashed_invocation(DEMO_UNIT, seed_lines(), restarts=1, invocation_id=uuid.uuid4().hex)
    stop = asyncio.Event()
    with JournalWriter(config.journal.directory) as writer:  # type: ignore[arg-type]
        writer.write(crash)
        task = asyncio.create_task(daemon.run(stop))
        try:
            await poll(lambda: len(store.history()) == 1, within=20, each=writer.nudge)
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
    store.close()
    assert slow and min(slow) >= SLOW_COMMIT_S
    assert commit_threads and threading.get_ident() not in commit_threads
    assert samples, "the probe sampled while the batch was handled"
    assert max(samples) / min(slow) < MAX_LAG_RATIO, (samples, slow)
