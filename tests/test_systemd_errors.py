"""D-Bus failures map to bounded SystemdError reasons, proven against a real dbus-daemon.

A private dbus-daemon runs on a socket in a temp dir, with a policy that denies RestartUnit; a
fake systemd (a dbus-fast service owning org.freedesktop.systemd1) answers the rest. This file
has no `from __future__ import annotations`: dbus-fast reads the D-Bus signatures from the
method annotations at class creation.
"""

# ruff: noqa: F821 - the string annotations are D-Bus signatures, not Python names.

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from dbus_fast import DBusError
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface, method
from fake_systemd import FakeService, FakeUnit, private_bus

from vllm_supervisor.actions.actor import Actor
from vllm_supervisor.actions.halt import Halter
from vllm_supervisor.actions.presence import Here
from vllm_supervisor.actions.quarantine import Quarantine
from vllm_supervisor.actions.systemd import SystemdClient
from vllm_supervisor.errors import SystemdError
from vllm_supervisor.model import (
    Action,
    Decision,
    Invocation,
    Outcome,
    Severity,
    Taken,
    UnitState,
    Verdict,
)
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

# RestartUnit is refused by the bus's policy: an access_denied from a real dbus-daemon.
DENY_RESTART = """
    <deny send_destination="org.freedesktop.systemd1"
          send_interface="org.freedesktop.systemd1.Manager" send_member="RestartUnit"/>"""

UNIT_PATH = "/org/freedesktop/systemd1/unit/vllm_2eservice"
INVOCATION = bytes.fromhex("0123456789abcdef0123456789abcdef")


def crashed_unit() -> FakeUnit:
    """vllm.service as systemd shows it between a crash and its restart."""
    return FakeUnit(active="activating", sub="auto-restart", invocation_id=INVOCATION)


GATE_ARGV = ["/usr/local/bin/vllm-supervisor", "gate", "--runtime-dir", "/run/x", "vllm.service"]
GATE = ["/usr/local/bin/vllm-supervisor", GATE_ARGV, False, 0, 0, 0, 0, 0, 0, 0]


def crashed_service() -> FakeService:
    """Its service: 3 automatic restarts, failed, a vllm serve command line, our gate."""
    argv = ["/opt/vllm/bin/vllm", ["vllm", "serve", "m"], False, 0, 0, 0, 0, 0, 0, 0]
    return FakeService(n_restarts=3, result="exit-code", exec_start=[argv], exec_condition=[GATE])


class FakeManager(ServiceInterface):
    """The parts of org.freedesktop.systemd1.Manager the client calls."""

    def __init__(self) -> None:
        super().__init__("org.freedesktop.systemd1.Manager")
        self.stops: list[str] = []
        self.hang = asyncio.Event()

    @method()
    def LoadUnit(self, name: "s") -> "o":
        if name == "missing.service":
            raise DBusError("org.freedesktop.systemd1.NoSuchUnit", f"Unit {name} not found.")
        return UNIT_PATH

    @method()
    async def StopUnit(self, name: "s", mode: "s") -> "o":
        if name == "hang.service":
            await self.hang.wait()
        self.stops.append(name)
        return "/org/freedesktop/systemd1/job/42"

    @method()
    def RestartUnit(self, name: "s", mode: "s") -> "o":
        return "/org/freedesktop/systemd1/job/43"


@pytest.fixture
def bus_address(tmp_path: Path) -> Iterator[str]:
    """A private dbus-daemon on a socket in a temp dir, stopped after the test."""
    with private_bus(tmp_path, deny=DENY_RESTART) as address:
        yield address


@pytest.fixture
async def fake_systemd(bus_address: str) -> AsyncIterator[tuple[FakeManager, FakeUnit]]:
    """A fake systemd owning org.freedesktop.systemd1 on the private bus."""
    bus = await MessageBus(bus_address=bus_address).connect()
    manager, unit = FakeManager(), crashed_unit()
    bus.export("/org/freedesktop/systemd1", manager)
    bus.export(UNIT_PATH, unit)
    bus.export(UNIT_PATH, crashed_service())
    await bus.request_name("org.freedesktop.systemd1")
    yield manager, unit
    manager.hang.set()
    bus.disconnect()


@pytest.fixture
async def client(bus_address: str) -> AsyncIterator[SystemdClient]:
    c = SystemdClient(bus_address=bus_address, timeout_s=0.5)
    yield c
    await c.close()


async def expect(reason: str, retryable: bool, call: object) -> SystemdError:
    with pytest.raises(SystemdError) as info:
        await call  # type: ignore[misc]
    assert info.value.reason == reason
    assert info.value.retryable is retryable
    assert info.value.__cause__ is not None
    return info.value


class TestErrorMapping:
    async def test_missing_socket_is_bus_unavailable(self, tmp_path: Path) -> None:
        """A bus socket that does not exist is a retryable bus_unavailable."""
        c = SystemdClient(bus_address=f"unix:path={tmp_path}/nope", timeout_s=0.5)
        await expect("bus_unavailable", True, c.stop_unit("vllm.service"))

    async def test_no_systemd_on_the_bus_is_bus_unavailable(self, client: SystemdClient) -> None:
        """A bus without org.freedesktop.systemd1 (ServiceUnknown) is bus_unavailable."""
        await expect("bus_unavailable", True, client.stop_unit("vllm.service"))

    async def test_policy_denial_is_access_denied(
        self, client: SystemdClient, fake_systemd: tuple[FakeManager, FakeUnit]
    ) -> None:
        """A call the bus policy forbids is a permanent access_denied."""
        await expect("access_denied", False, client.restart_unit("vllm.service"))

    async def test_unknown_unit_is_no_such_unit(
        self, client: SystemdClient, fake_systemd: tuple[FakeManager, FakeUnit]
    ) -> None:
        """systemd's NoSuchUnit is a permanent no_such_unit."""
        err = await expect("no_such_unit", False, client.unit_state("missing.service"))
        assert "missing.service" in str(err)

    async def test_no_answer_is_timeout(
        self, client: SystemdClient, fake_systemd: tuple[FakeManager, FakeUnit]
    ) -> None:
        """A call that gets no answer within timeout_s is a retryable timeout."""
        await expect("timeout", True, client.stop_unit("hang.service"))


class TestCalls:
    async def test_unit_state_reads_unit_and_service_properties(
        self, client: SystemdClient, fake_systemd: tuple[FakeManager, FakeUnit]
    ) -> None:
        """unit_state combines the Unit and Service properties into one snapshot."""
        state = await client.unit_state("vllm.service")
        assert state == UnitState(
            active_state="activating",
            sub_state="auto-restart",
            n_restarts=3,
            result="exit-code",
            invocation_id="0123456789abcdef0123456789abcdef",
            main_pid=0,
            gated=True,
        )
        assert await client.exec_start("vllm.service") == ["vllm", "serve", "m"]

    async def test_stop_unit_returns_the_job(
        self, client: SystemdClient, fake_systemd: tuple[FakeManager, FakeUnit]
    ) -> None:
        """StopUnit answers with the job path."""
        assert await client.stop_unit("vllm.service") == "/org/freedesktop/systemd1/job/42"
        assert fake_systemd[0].stops == ["vllm.service"]


FAKE_INVOCATION = "0123456789abcdef0123456789abcdef"  # the fake unit's InvocationID


def outcome(unit: str | None = "vllm.service", invocation_id: str = "abc") -> Outcome:
    return Outcome(
        invocation=Invocation(unit=unit, invocation_id=invocation_id, lines=(), exit_status=1),
        verdict=Verdict(
            signature="flashinfer_cubin_mismatch",
            severity=Severity.FATAL,
            title="flashinfer mismatch",
            root_cause="RuntimeError: flashinfer-cubin version (0.6.3) does not match",
        ),
        decision=Decision(action=Action.HALT, reason="known fatal crash"),
    )


HERE = Here(machine_id="", boot_id="", now_us=0, act_window_s=60.0)


def actor_on(quarantine: Quarantine, client: SystemdClient) -> Actor:
    """The daemon's actor, halting through `client` into `quarantine`."""
    halter = Halter(quarantine, client, attempts=3, timeout_s=1)
    return Actor(halter, client, Metrics(new_registry(process=False)))


async def no_sleep(_: float) -> None:
    return None


class TestHalter:
    async def test_halt_quarantines_then_stops(
        self,
        tmp_path: Path,
        client: SystemdClient,
        fake_systemd: tuple[FakeManager, FakeUnit],
    ) -> None:
        """A unit waiting to restart is quarantined and stopped."""
        q = Quarantine(tmp_path / "q")
        result = await Halter(q, client, attempts=3, timeout_s=1).halt(
            "vllm.service", outcome(), stop=True
        )
        assert result.stopped
        assert result.error is None
        assert result.stop_job == "/org/freedesktop/systemd1/job/42"
        record = q.read("vllm.service")
        assert record is not None
        assert record["signature"] == "flashinfer_cubin_mismatch"
        assert record["invocation_id"] == "abc"

    async def test_halt_of_an_inactive_unit_does_not_stop(
        self,
        tmp_path: Path,
        client: SystemdClient,
        fake_systemd: tuple[FakeManager, FakeUnit],
    ) -> None:
        """A unit already down is only quarantined (idempotent halt)."""
        fake_systemd[1].active, fake_systemd[1].sub = "failed", "failed"
        q = Quarantine(tmp_path / "q")
        result = await Halter(q, client, attempts=3, timeout_s=1).halt(
            "vllm.service", outcome(), stop=True
        )
        assert result.stopped
        assert result.stop_job is None
        assert fake_systemd[0].stops == []

    async def test_dry_run_changes_nothing(
        self,
        tmp_path: Path,
        client: SystemdClient,
        fake_systemd: tuple[FakeManager, FakeUnit],
    ) -> None:
        """A dry run writes no record, stops nothing and says what it would have done."""
        fake_systemd[1].sub = "auto-restart"
        q = Quarantine(tmp_path / "q")
        actor = actor_on(q, client)
        dry = dataclasses.replace(
            outcome(invocation_id=FAKE_INVOCATION),
            decision=Decision(action=Action.HALT, reason="known fatal crash", dry_run=True),
        )
        recorded = await actor.carry_out(dry, HERE)
        assert recorded.taken is Taken.WOULD_HALT
        assert "would quarantine vllm.service" in recorded.taken_detail
        assert q.list() == {}
        assert fake_systemd[0].stops == []

    async def test_a_gated_unit_waiting_to_restart_is_left_to_its_gate(
        self,
        tmp_path: Path,
        client: SystemdClient,
        fake_systemd: tuple[FakeManager, FakeUnit],
    ) -> None:
        """Auto-restart pending, our gate in ExecCondition=: the record is the halt, and no
        StopUnit races the restart (one landing as the restart's gate started killed it: a
        failed start, `gate_stopped`, in about 2 of 3 runs of the port e2e test)."""
        assert (await client.unit_state("vllm.service")).gated
        q = Quarantine(tmp_path / "q")
        actor = actor_on(q, client)
        recorded = await actor.carry_out(outcome(invocation_id=FAKE_INVOCATION), HERE)
        assert recorded.taken is Taken.HALTED, recorded.taken_detail
        assert "its gate refuses the restart" in recorded.taken_detail
        assert q.read("vllm.service") is not None
        assert fake_systemd[0].stops == []

    async def test_a_fatal_crash_of_a_unit_nothing_restarts_is_quarantined(
        self,
        tmp_path: Path,
        client: SystemdClient,
        fake_systemd: tuple[FakeManager, FakeUnit],
    ) -> None:
        """Was "nothing to halt": a `Restart=no` unit that a timer (or a dependency) starts
        again crashed fatally at every start, 22 starts and 22 messages, `status` "ok". The
        record keeps those starts off and the crash is told once; nothing is stopped."""
        fake_systemd[1].active, fake_systemd[1].sub = "failed", "failed"
        q = Quarantine(tmp_path / "q")
        actor = actor_on(q, client)
        recorded = await actor.carry_out(outcome(invocation_id=FAKE_INVOCATION), HERE)
        assert recorded.taken is Taken.HALTED, recorded.taken_detail
        assert "nothing restarts it" in recorded.taken_detail
        record = q.read("vllm.service")
        assert record is not None and record["invocation_id"] == FAKE_INVOCATION
        assert fake_systemd[0].stops == []

    async def test_a_transient_crash_under_remain_after_exit_is_restarted_here(
        self,
        tmp_path: Path,
        client: SystemdClient,
        fake_systemd: tuple[FakeManager, FakeUnit],
    ) -> None:
        """Active/exited with no process (RemainAfterExit=yes): systemd will not restart a unit
        it sees as active, so the supervisor does, where it would leave systemd to it."""
        fake_systemd[1].active, fake_systemd[1].sub = "active", "exited"
        actor = actor_on(Quarantine(tmp_path / "q"), client)
        transient = dataclasses.replace(
            outcome(invocation_id=FAKE_INVOCATION),
            decision=Decision(action=Action.ALLOW_RESTART, reason="transient crash"),
        )
        recorded = await actor.carry_out(transient, HERE)
        # This bus refuses RestartUnit (DENY_RESTART): the attempt, not "systemd restarts it".
        assert recorded.taken is Taken.RESTART_FAILED, recorded.taken_detail
        assert recorded.taken_detail.startswith("could not restart it (its server exited")
        assert "RemainAfterExit" in recorded.taken_detail

    async def test_unreachable_bus_still_quarantines(self, tmp_path: Path) -> None:
        """Without a bus the record is written and the error is reported after retries."""
        q = Quarantine(tmp_path / "q")
        dead = SystemdClient(bus_address=f"unix:path={tmp_path}/nope", timeout_s=0.5)
        halter = Halter(q, dead, attempts=3, timeout_s=1, sleep=no_sleep)
        result = await halter.halt("vllm.service", outcome(), stop=True)
        assert not result.stopped
        assert result.quarantined == q.path("vllm.service")
        assert result.error is not None
        assert result.error.reason == "bus_unavailable"
        assert "after 3 attempt(s)" in str(result.error)

    async def test_permanent_error_is_not_retried(
        self, tmp_path: Path, client: SystemdClient, fake_systemd: tuple[FakeManager, FakeUnit]
    ) -> None:
        """access_denied fails on the first attempt (restart is denied by the bus policy)."""
        halter = Halter(Quarantine(tmp_path / "q"), client, attempts=5, timeout_s=1)
        with pytest.raises(SystemdError, match=r"after 1 attempt\(s\)"):
            await halter.restart("vllm.service")


def test_the_error_tree_in_errors_py_is_the_code() -> None:
    """Every class drawn in supervisor/errors.py's docstring has the parent it is drawn under."""
    import re

    import vllm_supervisor.errors as errors

    classes = {c.__name__: c for c in _subclasses(errors.SupervisorError)}
    parents: list[str] = []
    drawn: set[str] = set()
    for line in (errors.__doc__ or "").splitlines():
        match = re.match(r"^([│ ]*)(?:[├└]── )?([A-Z]\w+(?:Error|Limited))\b", line)
        if match is None:
            continue
        depth = len(match.group(1)) // 4 + (1 if "──" in line else 0)
        name = match.group(2)
        parents = [*parents[:depth], name]
        if depth:
            assert classes[name].__bases__[0] is classes[parents[depth - 1]], line
        drawn.add(name)
    assert drawn == set(classes), f"not drawn: {sorted(set(classes) - drawn)}"


def _subclasses(base: type) -> set[type]:
    """`base` and every subclass of it defined in any module of the package."""
    import importlib
    import pkgutil

    import vllm_supervisor

    for module in pkgutil.walk_packages(vllm_supervisor.__path__, "vllm_supervisor."):
        if not module.name.endswith("__main__"):
            importlib.import_module(module.name)
    found, todo = {base}, [base]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("vllm_supervisor.") and sub not in found:
                found.add(sub)
                todo.append(sub)
    return found
