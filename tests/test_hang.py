"""Hung engines: the pure detector, the confirmation rules, and the daemon on a real journal."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from handfed import HandFed, running
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.actions.actor import Actor
from vllm_supervisor.actions.halt import Halter
from vllm_supervisor.actions.quarantine import Quarantine, quarantine_dir
from vllm_supervisor.app import compose_daemon
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.demo import demo_config
from vllm_supervisor.config import Config, UnitConfig, validate
from vllm_supervisor.daemon import Daemon
from vllm_supervisor.decide.hang import DEATH_HINTS, DEATH_PATTERNS, HangDetector, HangWatcher
from vllm_supervisor.errors import ConfigError
from vllm_supervisor.journal.writer import JournalWriter, lifecycle, service_lines
from vllm_supervisor.model import JournalEntry, LifecycleEvent, UnitState
from vllm_supervisor.store import Store
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

UNIT = "vllm.service"
INV = "a" * 32


class Clock:
    """A settable clock."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def line(text: str, inv: str = INV, unit: str = UNIT) -> JournalEntry:
    return JournalEntry(cursor="c", realtime_us=1, message=text, unit=unit, invocation_id=inv)


def pid1(event: LifecycleEvent, inv: str = INV) -> JournalEntry:
    return JournalEntry(
        cursor="c",
        realtime_us=1,
        message="systemd",
        unit=UNIT,
        invocation_id=inv,
        message_id=event.value,
        from_pid1=True,
    )


DEAD = "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."


_LINES = st.sampled_from(
    [
        DEAD,
        "INFO: 127.0.0.1 - GET /health 200",
        "Worker proc VllmWorker-1 died unexpectedly, shutting down executor.",
        "Engine process (pid 4) died",
        "died unexpectedly",  # a hint alone: the regex decides
        "EngineDeadError",
    ]
)
_ENTRIES = st.one_of(
    st.builds(line, _LINES | st.text(max_size=40), st.sampled_from([INV, "b" * 32])),
    st.builds(pid1, st.sampled_from(list(LifecycleEvent)), st.sampled_from([INV, "b" * 32])),
    st.builds(line, _LINES, unit=st.just("other.service")),
)


@given(batches=st.lists(st.lists(_ENTRIES, max_size=6), max_size=6))
def test_a_batch_is_observed_as_its_entries_one_by_one(batches: list[list[JournalEntry]]) -> None:
    """observe_batch skips batches that cannot matter: the deaths noted stay the same."""
    clock = Clock()
    whole, single = (HangDetector({UNIT: 30.0}, clock=clock) for _ in range(2))
    for batch in batches:
        whole.observe_batch(batch)
        for entry in batch:
            single.observe(entry)
        assert whole.next_due() == single.next_due()
        assert whole.due(clock.now + 31) == single.due(clock.now + 31)
        clock.now += 1


class TestHangDetector:
    @pytest.mark.parametrize(
        ("entries", "advance", "due"),
        [
            # vLLM V1: the API server logs EngineDeadError and keeps running.
            ([line(DEAD)], 31.0, [UNIT]),
            # Still inside the grace period.
            ([line(DEAD)], 29.0, []),
            # The engine core process died.
            (
                [line("ERROR Engine core proc EngineCore_0 died unexpectedly, shutting down")],
                31,
                [UNIT],
            ),
            # A worker died.
            (
                [line("Worker proc VllmWorker-1 died unexpectedly, shutting down executor.")],
                31,
                [UNIT],
            ),
            # Engine init failed but the API server stays up.
            (
                [line("RuntimeError: Engine core initialization failed. See root cause above.")],
                31,
                [UNIT],
            ),
            # SGLang's scheduler raised and nothing exits.
            (
                [line("[2025-01-01 10:00:00 TP0] Scheduler hit an exception: Traceback")],
                31,
                [UNIT],
            ),
            # An ordinary line is no death.
            ([line("INFO:     127.0.0.1:5000 - GET /health 200 OK")], 31, []),
            # The invocation ended: systemd saw the process exit, the journal tells the rest.
            ([line(DEAD), pid1(LifecycleEvent.PROCESS_EXITED)], 31, []),
            ([line(DEAD), pid1(LifecycleEvent.UNIT_FAILED)], 31, []),
            ([line(DEAD), pid1(LifecycleEvent.DEACTIVATED)], 31, []),
            # A new invocation started: the old one ended even without its end logged.
            ([line(DEAD), line("INFO starting", inv="b" * 32)], 31, []),
            # PID 1's other messages (restart scheduled) do not end the invocation.
            ([line(DEAD), pid1(LifecycleEvent.RESTART_SCHEDULED)], 31, [UNIT]),
            # A death line of a unit that is not supervised is ignored.
            ([line(DEAD, unit="other.service")], 31, []),
        ],
    )
    def test_due_after_grace(
        self, entries: list[JournalEntry], advance: float, due: list[str]
    ) -> None:
        """A death line makes its unit due once the grace period passes without an end."""
        clock = Clock()
        detector = HangDetector({UNIT: 30.0}, clock=clock)
        for entry in entries:
            detector.observe(entry)
        assert detector.due(clock.now + advance) == due

    def test_first_death_line_starts_the_grace_period(self) -> None:
        """Later death lines of the same invocation do not push the deadline back."""
        clock = Clock()
        detector = HangDetector({UNIT: 30.0}, clock=clock)
        detector.observe(line(DEAD))
        clock.now += 20
        detector.observe(line(DEAD))
        assert detector.next_due() == 1030.0

    def test_postpone_and_forget(self) -> None:
        """A postponed unit is due later; a forgotten one never."""
        clock = Clock()
        detector = HangDetector({UNIT: 1.0}, clock=clock)
        detector.observe(line(DEAD))
        detector.postpone(UNIT, 2000.0)
        assert detector.due(1500.0) == []
        assert detector.due(2000.0) == [UNIT]
        detector.forget(UNIT)
        assert detector.due(5000.0) == []
        assert detector.next_due() is None


class TestHealthUrlConfig:
    @pytest.mark.parametrize(
        ("url", "ok"),
        [
            ("http://127.0.0.1:8000/health", True),
            ("http://localhost:8000/health", True),
            ("http://[::1]:8000/health", True),
            ("http://10.0.0.5:8000/health", False),  # another host: refused
            ("http://example.com/health", False),
            ("ftp://127.0.0.1/health", False),  # not http
        ],
    )
    def test_only_loopback(self, url: str, ok: bool) -> None:
        """A health URL must name a loopback host; anything else is a config error."""
        config = Config(units=(UnitConfig(name=UNIT, health_url=url),))
        if ok:
            validate(config)
        else:
            with pytest.raises(ConfigError, match=r"unit\[0\]\.health_url"):
                validate(config)


class FakeSystemd:
    """Reports a fixed ActiveState, counts the calls and records restarts and stops."""

    def __init__(self, active_state: str) -> None:
        self.active_state = active_state
        self.calls = 0
        self.restarted: list[str] = []
        self.stopped: list[str] = []

    async def restart_unit(self, unit: str) -> str:
        self.restarted.append(unit)
        return "/job/1"

    async def stop_unit(self, unit: str) -> str:
        self.stopped.append(unit)
        return "/job/2"

    async def unit_state(self, unit: str) -> UnitState:
        self.calls += 1
        return UnitState(
            active_state=self.active_state,
            sub_state="running",
            n_restarts=0,
            result="success",
            invocation_id=INV,
            main_pid=1,
        )


def _config(root: Path, **unit: object) -> Config:
    base = demo_config(root)
    return dataclasses.replace(
        base,
        units=(UnitConfig(**{"name": UNIT, "hang_grace_s": 0.5, **unit}),),  # type: ignore[arg-type]
        metrics=dataclasses.replace(base.metrics, enabled=False),
    )


@pytest.fixture(name="store")
def _store(tmp_path: Path) -> Iterator[Store]:
    store = Store.in_directory(tmp_path / "state")
    yield store
    store.close()


def _daemon(
    config: Config,
    store: Store,
    systemd: FakeSystemd | None = None,
    *,
    watcher: HangWatcher | None = None,
    by_hand: bool = False,
) -> Daemon:
    """The daemon on `config`'s journal; `by_hand`: on no journal, the test hands it batches
    and checks the watcher itself."""
    halter = Halter(
        Quarantine(quarantine_dir(config)),
        systemd,  # type: ignore[arg-type]
        attempts=1,
        timeout_s=1,
    )
    metrics = Metrics(new_registry(process=False))
    return compose_daemon(
        config,
        load_table(config),
        store=store,
        metrics=metrics,
        actor=Actor(halter, systemd, metrics),
        hooks=[watcher] if watcher is not None else [],
        sources=[watcher] if watcher is not None and not by_hand else [],
        reader=HandFed() if by_hand else None,
    )


class TestHangWatcher:
    @pytest.mark.parametrize(
        ("active_state", "healthy", "hung", "restarted"),
        [
            # Active and the health URL fails: hung; an unknown crash is restarted.
            ("active", False, True, True),
            # Systemd already stops or restarts it: the journal will show the end.
            ("deactivating", False, False, False),
            # The health URL answers 2xx: the API recovered, no hang.
            ("active", True, False, False),
        ],
    )
    async def test_confirmation(
        self,
        tmp_path: Path,
        store: Store,
        active_state: str,
        healthy: bool,
        hung: bool,
        restarted: bool,
    ) -> None:
        """A due unit is handled only when systemd says active and the health URL fails."""
        config = _config(tmp_path, health_url="http://127.0.0.1:1/health")
        systemd = FakeSystemd(active_state)
        clock = Clock()

        async def health(url: str) -> bool:
            return not healthy

        watcher = HangWatcher(config, systemd=systemd, health=health, clock=clock)
        daemon = _daemon(config, store, systemd, watcher=watcher, by_hand=True)
        async with running(daemon):
            await daemon.handle_batch([line("INFO starting"), line(DEAD)])
            clock.now += 1
            assert watcher.detector.due(clock.now) == [UNIT]
            outcome = await watcher.check(UNIT, daemon)
        assert (outcome is not None) == hung
        assert systemd.calls == (2 if hung else 1)  # the watcher's check, then the actor's
        assert systemd.restarted == ([UNIT] if restarted else [])
        assert [h["hung"] for h in store.history()] == ([True] if hung else [])
        assert watcher.detector.due(clock.now + 100) == []

    async def test_later_lines_of_a_hung_invocation_are_ignored(
        self, tmp_path: Path, store: Store
    ) -> None:
        """After a hang is handled, the invocation's own end is not recorded a second time."""
        config = _config(tmp_path, health_url="http://127.0.0.1:1/health")
        clock = Clock()

        async def health(url: str) -> bool:
            return True  # failing

        watcher = HangWatcher(config, systemd=None, health=health, clock=clock)
        daemon = _daemon(config, store, watcher=watcher, by_hand=True)
        async with running(daemon):
            await daemon.handle_batch([line("INFO starting"), line(DEAD)])
            clock.now += 1
            assert await watcher.check(UNIT, daemon) is not None
            outcomes = await daemon.handle_batch(
                [line("INFO shutting down"), pid1(LifecycleEvent.DEACTIVATED)]
            )
        assert outcomes == []
        assert len(store.history()) == 1


async def _serve_500() -> asyncio.Server:
    """A loopback HTTP server whose every answer is 500, as vLLM's /health after its engine died."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


async def test_daemon_records_a_hung_engine_on_a_real_journal(tmp_path: Path, store: Store) -> None:
    """EngineDeadError with the unit still up and /health at 500 is recorded as hung and decided."""
    server = await _serve_500()
    port = server.sockets[0].getsockname()[1]
    config = _config(tmp_path, health_url=f"http://127.0.0.1:{port}/health", hang_grace_s=1.0)
    daemon = _daemon(config, store, watcher=HangWatcher(config, systemd=None))
    inv = uuid.uuid4().hex
    entries = [
        lifecycle(UNIT, inv, LifecycleEvent.JOB_STARTED, f"Started {UNIT}.", JOB_RESULT="done"),
        *service_lines(
            UNIT,
            inv,
            [
                "INFO:     Application startup complete.",
                "ERROR [core.py:586] EngineCore encountered a fatal error.",
                "ERROR [async_llm.py:420] AsyncLLM output_handler failed.",
                DEAD,
                'INFO:     127.0.0.1:40000 - "POST /v1/completions HTTP/1.1" 500',
            ],
        ),
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    with JournalWriter(config.journal.directory) as writer:  # type: ignore[arg-type]
        writer.write(entries)
        task = asyncio.create_task(daemon.run(stop))
        started = loop.time()
        try:
            while not store.history():
                assert loop.time() - started < 15, "no hang recorded"
                assert not task.done(), task
                writer.nudge()
                await asyncio.sleep(0.05)  # polling with a deadline
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
            server.close()
            await server.wait_closed()
    [record] = store.history()
    assert record["invocation_id"] == inv
    assert record["hung"] is True
    assert record["decision"]["action"] in ("allow-restart", "halt")
    assert "EngineCore" in (record["verdict"]["root_cause"] or "")
    hung = daemon.metrics.registry.get_sample_value(
        "vllm_supervisor_hung_engines_total",
        {"unit": UNIT, "action": record["decision"]["action"]},
    )
    assert hung == 1.0


@pytest.mark.parametrize("pattern", DEATH_PATTERNS)
@given(data=st.data())
def test_every_death_line_passes_the_literal_prefilter(pattern: str, data: st.DataObject) -> None:
    """The prefilter only skips the regex: any line a death pattern matches holds a hint."""
    line = data.draw(st.from_regex(pattern))
    assert any(hint in line for hint in DEATH_HINTS), line


def test_the_prefilter_changes_no_verdict() -> None:
    """With and without the prefilter the detector notes the same lines."""
    lines = [DEAD, "INFO ok", "Engine core proc EngineCore_0 died unexpectedly", "died"]
    for text in lines:
        fast, plain = (
            HangDetector({UNIT: 1.0}),
            HangDetector({UNIT: 1.0}, patterns=[*DEATH_PATTERNS]),
        )
        fast.observe(line(text))
        plain.observe(line(text))
        assert (fast.death(UNIT) is None) == (plain.death(UNIT) is None), text


async def test_a_gate_of_a_unit_the_config_does_not_name_is_answered_at_once(
    tmp_path: Path, store: Store
) -> None:
    """A drop-in left on a unit removed from the config made every start wait `gate.wait_s`
    (30 s) for a decision nobody would make: the daemon says at once it does not supervise it."""
    daemon = _daemon(_config(tmp_path), store)
    answer = await asyncio.wait_for(daemon.gate_answer("other.service", "b" * 32, 30.0), 5.0)
    assert answer == {"ok": True, "decided": True, "supervised": False}
