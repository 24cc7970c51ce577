"""Drift in the daemon: snapshots at each start, good starts, and the changes shown on a crash."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import MappingProxyType

import pytest
from conftest import poll
from handfed import HandFed, running

from vllm_supervisor.app import compose_daemon
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.demo import demo_config
from vllm_supervisor.commands.triage import render_text
from vllm_supervisor.config import Config, DriftConfig, TrackerConfig, UnitConfig
from vllm_supervisor.daemon import Daemon
from vllm_supervisor.environment.drift import DriftRecorder, RecordedDrift
from vllm_supervisor.environment.log import EnvironmentLog
from vllm_supervisor.environment.snapshot import EnvSnapshot
from vllm_supervisor.model import (
    Action,
    Ended,
    Evidence,
    JournalEntry,
    LifecycleEvent,
    Outcome,
    Phase,
)
from vllm_supervisor.notify.message import build_payload
from vllm_supervisor.store import Store
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

UNIT = "vllm.service"
FATAL = "RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version (0.6.4)."


class FakeEnv:
    """The served interpreter's packages, changed by the test between starts."""

    def __init__(self) -> None:
        self.packages = {"torch": "2.5.1", "flashinfer-python": "0.6.3"}
        self.pythons: list[Path] = []

    def __call__(self, python: Path, packages: Sequence[str]) -> EnvSnapshot:
        self.pythons.append(python)
        return EnvSnapshot(
            python="3.11.9",
            packages=MappingProxyType(dict(self.packages)),
            checked=("flashinfer-python", "torch"),
        )


class Journal:
    """Builds entries of one unit with increasing timestamps near now."""

    def __init__(self) -> None:
        self.us = int(time.time() * 1e6)

    def _next(self) -> int:
        self.us += 1000
        return self.us

    def line(self, inv: str, text: str) -> JournalEntry:
        return JournalEntry(
            cursor=f"c{self.us}",
            realtime_us=self._next(),
            message=text,
            unit=UNIT,
            invocation_id=inv,
            pid=7,
        )

    def starting(self, inv: str) -> JournalEntry:
        """PID 1's "Starting U..." of a new invocation (JOB_TYPE=start)."""
        return JournalEntry(
            cursor=f"s{self.us}",
            realtime_us=self._next(),
            message=f"Starting {UNIT}...",
            unit=UNIT,
            invocation_id=inv,
            from_pid1=True,
            message_id=LifecycleEvent.STARTING.value,
            fields=MappingProxyType({"JOB_TYPE": "start"}),
        )

    def ended(self, inv: str, status: int) -> list[JournalEntry]:
        exited = JournalEntry(
            cursor="x",
            realtime_us=self._next(),
            message="exited",
            unit=UNIT,
            invocation_id=inv,
            from_pid1=True,
            message_id=LifecycleEvent.PROCESS_EXITED.value,
            fields=MappingProxyType({"EXIT_CODE": "exited", "EXIT_STATUS": str(status)}),
        )
        event = LifecycleEvent.UNIT_FAILED if status else LifecycleEvent.DEACTIVATED
        result = {"UNIT_RESULT": "exit-code"} if status else {}
        end = JournalEntry(
            cursor="y",
            realtime_us=self._next(),
            message="ended",
            unit=UNIT,
            invocation_id=inv,
            from_pid1=True,
            message_id=event.value,
            fields=MappingProxyType(result),
        )
        return [exited, end]


@pytest.fixture(name="store")
def _store(tmp_path: Path) -> Iterator[Store]:
    store = Store.in_directory(tmp_path / "state")
    yield store
    store.close()


def _setup(
    tmp_path: Path,
    store: Store,
    env: FakeEnv,
    *,
    good_start_s: float = 600.0,
) -> tuple[Daemon, DriftRecorder]:
    base = demo_config(tmp_path)
    config: Config = dataclasses.replace(
        base,
        units=(UnitConfig(name=UNIT, python="/opt/venv/bin/python"),),
        drift=DriftConfig(good_start_s=good_start_s),
        # Decide on PID 1's "Failed" message itself: these tests feed whole batches.
        tracker=TrackerConfig(settle_s=0),
    )
    metrics = Metrics(new_registry(process=False))
    recorder = DriftRecorder(
        config,
        EnvironmentLog(store),
        exec_start=None,
        snapshotter=env,
        on_snapshot=metrics.environment_snapshot,
    )
    daemon = compose_daemon(
        config,
        load_table(config),
        reader=HandFed(),
        store=store,
        metrics=metrics,
        hooks=[recorder],
    )
    return daemon, recorder


async def _crash_after_upgrade(daemon: Daemon, env: FakeEnv, *, serving: bool) -> list[Outcome]:
    journal = Journal()
    first = [journal.line("a" * 32, "INFO loading")]
    if serving:
        first.append(journal.line("a" * 32, "INFO:     Application startup complete."))
    await daemon.handle_batch([*first, *journal.ended("a" * 32, 0)])
    envlog = EnvironmentLog(daemon.store)
    # The first start's snapshot is taken.
    await poll(lambda: envlog.for_invocation(UNIT, "a" * 32) is not None, within=10)
    env.packages["flashinfer-python"] = "0.6.4"
    crash = [journal.line("b" * 32, "INFO loading"), journal.line("b" * 32, FATAL)]
    return await daemon.handle_batch([*crash, *journal.ended("b" * 32, 1)])


class TestDriftRecorder:
    @pytest.mark.parametrize(
        ("serving", "good_start_s", "drift"),
        [
            # The first start served: the crash names what changed since.
            (True, 600.0, ("flashinfer-python 0.6.3 → 0.6.4",)),
            # It never said it served but ran longer than good_start_s: also a good start.
            (False, 0.000001, ("flashinfer-python 0.6.3 → 0.6.4",)),
            # No good start yet: no baseline, so no drift is claimed.
            (False, 600.0, ()),
        ],
    )
    async def test_crash_shows_changes_since_last_good_start(
        self,
        tmp_path: Path,
        store: Store,
        serving: bool,
        good_start_s: float,
        drift: tuple[str, ...],
    ) -> None:
        """A crash's outcome and its history carry the changes since the last good start."""
        env = FakeEnv()
        daemon, recorder = _setup(tmp_path, store, env, good_start_s=good_start_s)
        stop = asyncio.Event()
        task = asyncio.create_task(recorder.run(stop))
        try:
            async with running(daemon):
                outcomes = await _crash_after_upgrade(daemon, env, serving=serving)
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
        crashed = [o for o in outcomes if o.invocation.invocation_id == "b" * 32]
        assert [o.drift for o in crashed] == [drift]
        assert store.history()[-1]["drift"] == list(drift)
        assert env.pythons == [Path("/opt/venv/bin/python")] * 2
        recorded = daemon.metrics.registry.get_sample_value(
            "vllm_supervisor_environment_snapshots_total", {"unit": UNIT, "outcome": "recorded"}
        )
        assert recorded == 2.0
        # `triage` of the same crash on this host finds the change in the daemon's database.
        recorded = RecordedDrift(tmp_path / "state")
        bare = Evidence(phase=Phase(served=serving))
        found = [
            recorded.evidence(Ended(invocation=o.invocation, reading=o.verdict), bare).drift
            for o in crashed
        ]
        recorded.close()
        assert found == [drift]
        assert render_text(crashed).count("0.6.3 → 0.6.4") == len(
            [d for d in drift if "0.6.4" in d]
        )

    async def test_old_starts_are_not_snapshotted(self, tmp_path: Path, store: Store) -> None:
        """A start read long after it happened is not given today's environment."""
        env = FakeEnv()
        daemon, recorder = _setup(tmp_path, store, env)
        old = JournalEntry(
            cursor="c",
            realtime_us=1_000_000,
            message="INFO loading",
            unit=UNIT,
            invocation_id="c" * 32,
        )
        stop = asyncio.Event()
        task = asyncio.create_task(recorder.run(stop))
        async with running(daemon):
            await daemon.handle_batch([old])
        stop.set()
        await asyncio.wait_for(task, 5)
        assert env.pythons == []


UNKNOWN = "RuntimeError: widget 7 fell over"  # no signature knows it, no class says either way


async def _unknown_crash_after(daemon: Daemon, env: FakeEnv, *, upgrade: bool) -> Outcome:
    """A good start, then (after an upgrade or not) a start that crashes on UNKNOWN while
    loading, once its own snapshot is kept (the server loads for minutes: it always is)."""
    journal, envlog = Journal(), EnvironmentLog(daemon.store)
    first = [journal.line("a" * 32, "INFO:     Application startup complete.")]
    await daemon.handle_batch([*first, *journal.ended("a" * 32, 0)])
    await poll(lambda: envlog.for_invocation(UNIT, "a" * 32) is not None, within=10)
    if upgrade:
        env.packages["flashinfer-python"] = "0.6.4"
    await daemon.handle_batch([journal.starting("b" * 32), journal.line("b" * 32, "INFO loading")])
    await poll(lambda: envlog.for_invocation(UNIT, "b" * 32) is not None, within=10)
    outcomes = await daemon.handle_batch(
        [journal.line("b" * 32, UNKNOWN), *journal.ended("b" * 32, 1)]
    )
    (crashed,) = [o for o in outcomes if o.invocation.invocation_id == "b" * 32]
    return crashed


class TestDriftAsEvidence:
    @pytest.mark.parametrize(
        ("upgrade", "action", "rule"),
        [
            # A crash no signature knows, right after a package changed, before serving: the
            # change is why it crashed, and the next start has the same packages.
            (True, Action.HALT, "inferred_fatal"),
            # The same crash with nothing changed: unknown, restarted until it repeats.
            (False, Action.ALLOW_RESTART, "unknown_first"),
        ],
    )
    async def test_unknown_crash_after_a_change_is_inferred_fatal(
        self, tmp_path: Path, store: Store, upgrade: bool, action: Action, rule: str
    ) -> None:
        """The decision reads the drift the daemon recorded, and its reason names it."""
        env = FakeEnv()
        daemon, recorder = _setup(tmp_path, store, env, good_start_s=600.0)
        stop = asyncio.Event()
        task = asyncio.create_task(recorder.run(stop))
        try:
            async with running(daemon):
                crashed = await _unknown_crash_after(daemon, env, upgrade=upgrade)
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
        assert (crashed.decision.action, crashed.decision.rule) == (action, rule)
        reason = crashed.verdict.severity_reason or ""
        assert ("flashinfer-python 0.6.3 → 0.6.4" in reason) is upgrade, reason
        assert crashed.verdict.basis == ("inferred" if upgrade else "unknown")


class TestSlackDrift:
    def test_payload_names_the_changes(self, tmp_path: Path, store: Store) -> None:
        """A crash with drift shows the changes in the blocks and the fallback text."""
        env = FakeEnv()
        daemon, _ = _setup(tmp_path, store, env)
        journal = Journal()
        [outcome] = daemon.pipeline.decide_all(
            daemon.pipeline.feed([journal.line("d" * 32, FATAL), *journal.ended("d" * 32, 1)])
        )
        outcome = dataclasses.replace(outcome, drift=("torch 2.5.1 → 2.6.0",))
        payload = build_payload(outcome, host="gpu1")
        assert "Changed since the last good start: torch 2.5.1 → 2.6.0" in payload["text"]
        assert any("torch 2.5.1 → 2.6.0" in str(b) for b in payload["blocks"])
        plain = build_payload(dataclasses.replace(outcome, drift=()), host="gpu1")
        assert "Changed since" not in str(plain)
