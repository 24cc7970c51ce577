"""A gate that finds no daemon waits for one systemd is bringing back, and only for that one.

Was: every start found no daemon while the supervisor restarted (or was restarted after a kill)
and went ahead, so a fatal crash that ended in that moment was started again, several times at
`RestartSec=100ms`, before the new daemon read it (the nspawn test,
tests/e2e/test_supervisor_restart_e2e.py, shows it on systemd 252). systemd is a fake on a real
private dbus-daemon here; the daemon's side is the real gate server on a real Unix socket.
"""

# ruff: noqa: F821 - the string annotations are D-Bus signatures, not Python names.

import asyncio
import contextlib
import io
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dbus_fast.aio import MessageBus
from dbus_fast.service import PropertyAccess, ServiceInterface, dbus_property, method
from fake_systemd import FakeJob, FakeService, FakeUnit, private_bus, served_from_a_thread
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.actions.comeback import SupervisorUnit, ask_about, coming_back
from vllm_supervisor.actions.gatekeeper import GateServer, socket_path
from vllm_supervisor.actions.quarantine import Quarantine
from vllm_supervisor.commands.gate import EXIT_ALLOW, EXIT_QUARANTINED, gate_main
from vllm_supervisor.model import UnitState

UNIT = "vllm.service"
SUPERVISOR_PATH = "/org/freedesktop/systemd1/unit/vllm_2dsupervisor_2eservice"
JOB_PATH = "/org/freedesktop/systemd1/job/7"


class FakeManager(ServiceInterface):
    def __init__(self) -> None:
        super().__init__("org.freedesktop.systemd1.Manager")

    @method()
    def LoadUnit(self, name: "s") -> "o":
        return SUPERVISOR_PATH


def supervisor_systemd(address: str, unit: FakeUnit, job: str | None) -> Any:
    async def serve() -> MessageBus:
        bus = await MessageBus(bus_address=address).connect()
        bus.export("/org/freedesktop/systemd1", FakeManager())
        bus.export(SUPERVISOR_PATH, unit)
        bus.export(SUPERVISOR_PATH, FakeService())
        if job is not None:
            bus.export(JOB_PATH, FakeJob(job))
        await bus.request_name("org.freedesktop.systemd1")
        return bus

    return serve


@pytest.fixture
def runtime(tmp_path: Path) -> Path:
    directory = tmp_path / "run"
    directory.mkdir()
    return directory


@contextlib.contextmanager
def systemd_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unit: FakeUnit, job: str | None = None
) -> Iterator[None]:
    bus_dir = tmp_path / "bus"
    bus_dir.mkdir()
    with (
        private_bus(bus_dir) as address,
        served_from_a_thread(supervisor_systemd(address, unit, job)),
    ):
        monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", address)
        yield


class DaemonComingBack:
    """The new daemon: listens after `delay_s`, quarantines the unit, then answers decided."""

    def __init__(self, runtime: Path, delay_s: float) -> None:
        self.runtime, self.delay_s = runtime, delay_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server: GateServer | None = None

    async def _ready(self, unit: str, invocation_id: str | None, wait_s: float) -> dict[str, Any]:
        Quarantine(self.runtime / "quarantine").write(unit, {"signature": "fatal_sig"})
        return {"ok": True, "decided": True}

    async def _start(self) -> None:
        await asyncio.sleep(self.delay_s)  # the daemon's restart, not a synchronisation
        self.server = GateServer(
            socket_path(self.runtime), ready=self._ready, released=lambda _: None, wait_s=5.0
        )
        await self.server.start()

    def __enter__(self) -> "DaemonComingBack":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


def gate(runtime: Path, tmp_path: Path, comeback_s: float) -> tuple[int, str, float]:
    out = io.StringIO()
    started = time.monotonic()
    status = gate_main(
        UNIT,
        runtime,
        tmp_path / "state",
        wait_s=5.0,
        out=out,
        defaults=(),
        invocation_id="0" * 32,
        supervisor_wait_s=comeback_s,
    )
    return status, out.getvalue(), time.monotonic() - started


def left_active(seconds_ago: float) -> int:
    """An ActiveExitTimestampMonotonic of `seconds_ago` (this host's CLOCK_MONOTONIC, in µs)."""
    return int((time.clock_gettime(time.CLOCK_MONOTONIC) - seconds_ago) * 1e6)


def restarting(sub: str, job: int = 0, left_s_ago: float = 1.0) -> Callable[[], FakeUnit]:
    """The supervisor's unit, `left_s_ago` after it stopped being active."""
    active = "deactivating" if sub.startswith("stop") else "activating"
    pending = (job, JOB_PATH) if job else (0, "/")
    return lambda: FakeUnit(
        active=active, sub=sub, job=pending, active_exit_us=left_active(left_s_ago)
    )


@pytest.mark.parametrize(
    ("unit", "job"),
    [
        (restarting("auto-restart"), None),  # a crash, a kill, the watchdog's kill
        (restarting("stop-sigterm", job=7), "restart"),  # systemctl restart, in its stop
        (restarting("start", job=7), "start"),  # ... and in its start
        (restarting("stop-post"), None),  # going down on its own, Restart= to follow
    ],
)
def test_a_gate_waits_for_the_supervisor_systemd_brings_back(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    runtime: Path,
    unit: Callable[[], FakeUnit],
    job: str | None,
) -> None:
    with (
        systemd_says(tmp_path, monkeypatch, unit(), job),
        DaemonComingBack(runtime, delay_s=0.8),
    ):
        status, said, _ = gate(runtime, tmp_path, comeback_s=20.0)
    assert status == EXIT_QUARANTINED, said
    assert said.count("waiting for the supervisor") == 1, said


@pytest.mark.parametrize(
    ("unit", "job"),
    [
        (lambda: FakeUnit(active="inactive", sub="dead"), None),  # stopped
        (lambda: FakeUnit(active="failed", sub="failed"), None),  # failed, nothing restarts it
        (lambda: FakeUnit(active="deactivating", sub="stop-sigterm", job=(7, JOB_PATH)), "stop"),
        (lambda: FakeUnit(active="active", sub="running"), None),  # runs, but nothing listens
        # Never came up this boot (a start at boot), or keeps failing to (a crash loop on a
        # missing credential): every start would wait for it in vain.
        (lambda: FakeUnit(active="activating", sub="start", job=(7, JOB_PATH)), "start"),
        (restarting("auto-restart", left_s_ago=600), None),
    ],
)
def test_a_supervisor_nothing_brings_back_is_not_waited_for(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    runtime: Path,
    unit: Callable[[], FakeUnit],
    job: str | None,
) -> None:
    with systemd_says(tmp_path, monkeypatch, unit(), job):
        status, said, took = gate(runtime, tmp_path, comeback_s=20.0)
    assert status == EXIT_ALLOW
    assert "no supervisor is running" in said
    assert "waiting for the supervisor" not in said
    assert took < 5.0, f"the gate held a start {took:.1f} s for a supervisor not coming back"


def test_the_wait_for_a_supervisor_that_never_comes_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runtime: Path
) -> None:
    with systemd_says(tmp_path, monkeypatch, restarting("auto-restart", left_s_ago=0)()):
        status, said, took = gate(runtime, tmp_path, comeback_s=1.0)
    assert status == EXIT_ALLOW
    assert "was not back within 1 s" in said
    assert took < 5.0


def test_without_systemd_the_gate_does_not_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runtime: Path
) -> None:
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path}/no-bus")
    status, said, took = gate(runtime, tmp_path, comeback_s=20.0)
    assert status == EXIT_ALLOW
    assert "waiting for the supervisor" not in said
    assert took < 5.0


STATES = st.sampled_from(["active", "activating", "deactivating", "inactive", "failed", "x"])
SUBS = st.sampled_from(
    ["running", "start", "auto-restart", "stop-sigterm", "stop-watchdog", "dead", "failed", ""]
)
JOBS = st.sampled_from(["", "start", "restart", "stop", "reload", "verify-active", "nop", "?"])


@given(
    active=STATES,
    sub=SUBS,
    job=JOBS,
    inactive_for_s=st.one_of(st.none(), st.floats(min_value=0, max_value=1e6)),
)
def test_coming_back_follows_the_job_then_the_state(
    active: str, sub: str, job: str, inactive_for_s: float | None
) -> None:
    state = UnitState(
        active_state=active,
        sub_state=sub,
        n_restarts=0,
        result="",
        invocation_id="",
        main_pid=0,
    )
    why = coming_back(SupervisorUnit(state, job, inactive_for_s), within_s=45.0)
    starting = job in ("start", "restart", "verify-active")
    if job and not starting:
        assert why is None  # a stop (or any other job) is not a comeback
    elif active in ("active", "reloading"):
        assert (why is not None) == starting
    elif inactive_for_s is None or inactive_for_s > 45.0:
        assert why is None  # never up, or down for longer than a restart takes
    elif starting:
        assert why is not None and job in why
    elif sub == "auto-restart" or active in ("activating", "deactivating"):
        assert why is not None
    else:
        assert why is None


class _OddTimestampUnit(FakeUnit):
    """A unit whose ActiveExitTimestampMonotonic is a string, not systemd's `t`."""

    @dbus_property(access=PropertyAccess.READ)
    def ActiveExitTimestampMonotonic(self) -> "s":
        return "12 seconds ago"


def test_a_leaving_time_of_another_type_says_no_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor's unit as systemd says it, without a time it left "active" when that
    property comes in another type: the gate still learns the state, and nothing raises."""
    unit = _OddTimestampUnit(active="activating", sub="auto-restart")
    with systemd_says(tmp_path, monkeypatch, unit):
        seen = ask_about()
    assert seen is not None
    assert seen.state.active_state == "activating"
    assert seen.inactive_for_s is None
