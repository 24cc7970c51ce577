"""One unit's StopUnit that systemd never answers holds neither another unit's halt nor a gate.

Was: the actor ran under the daemon's batch lock, so a StopUnit of one unit that took its whole
timeout (systemd busy, a bus that stalls; retried up to `stop_attempts` x `stop_timeout_s`)
held every other unit's batch, the settle loop and every gate's "decided" answer behind it.
systemd is a fake on a real private dbus-daemon whose StopUnit of one unit never answers; the
daemon, its actor and halter, the D-Bus client, the gate server and the gate command are real,
and the journal is a real one.
"""

# ruff: noqa: F821 - the string annotations are D-Bus signatures, not Python names.

import asyncio
import contextlib
import dataclasses
import io
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from conftest import poll
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface, method
from fake_systemd import FakeService, FakeUnit, private_bus, served_from_a_thread

from vllm_supervisor.actions.actor import Actor
from vllm_supervisor.actions.gatekeeper import GateServer, socket_path
from vllm_supervisor.actions.halt import Halter
from vllm_supervisor.actions.quarantine import Quarantine, quarantine_dir
from vllm_supervisor.actions.systemd import SystemdClient
from vllm_supervisor.app import compose_daemon
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.demo import demo_config, seed_lines
from vllm_supervisor.commands.gate import EXIT_QUARANTINED, gate_main
from vllm_supervisor.config import Config, SystemdConfig, TrackerConfig, UnitConfig
from vllm_supervisor.daemon import Daemon
from vllm_supervisor.journal.writer import JournalWriter, crashed_invocation, start_entries
from vllm_supervisor.model import Taken
from vllm_supervisor.store import Store
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

STALLED, OTHER = "stalled.service", "other.service"
STOP_TIMEOUT_S = 8.0  # how long the halter waits for the stalled StopUnit (one attempt)
PROMPT_S = 3.0  # the other unit's halt and its gate's answer come well within this


def unit_path(unit: str) -> str:
    return "/org/freedesktop/systemd1/unit/" + unit.replace(".", "_2e")


class StallingManager(ServiceInterface):
    """The manager's LoadUnit and StopUnit; StopUnit of `stalled` never answers (until the test
    ends), any other is a job at once."""

    def __init__(self, stalled: str) -> None:
        super().__init__("org.freedesktop.systemd1.Manager")
        self.stalled = stalled
        self.stops: list[tuple[str, float]] = []  # (unit, time.monotonic() of the call)
        self.release = asyncio.Event()  # made on the fake's own loop, in `serve`

    @method()
    def LoadUnit(self, name: "s") -> "o":
        return unit_path(name)

    @method()
    async def StopUnit(self, name: "s", mode: "s") -> "o":
        self.stops.append((name, time.monotonic()))
        if name == self.stalled:
            await self.release.wait()
        return "/org/freedesktop/systemd1/job/1"


@dataclasses.dataclass
class Systemd:
    address: str
    manager: StallingManager
    loop: asyncio.AbstractEventLoop

    def stopped(self, unit: str) -> bool:
        return any(name == unit for name, _ in self.manager.stops)


@contextlib.contextmanager
def systemd_restarting(tmp_path: Path, invocations: dict[str, str]) -> Iterator[Systemd]:
    """A systemd whose units each wait in auto-restart after their crash `invocations[unit]`."""
    bus_dir = tmp_path / "bus"
    bus_dir.mkdir()
    manager = StallingManager(STALLED)
    loops: list[asyncio.AbstractEventLoop] = []

    async def serve() -> MessageBus:
        loops.append(asyncio.get_running_loop())
        manager.release = asyncio.Event()
        bus = await MessageBus(bus_address=address).connect()
        bus.export("/org/freedesktop/systemd1", manager)
        for unit, invocation_id in invocations.items():
            state = FakeUnit(active="activating", sub="auto-restart")
            state.invocation_id = bytes.fromhex(invocation_id)
            bus.export(unit_path(unit), state)
            bus.export(unit_path(unit), FakeService(n_restarts=1, result="exit-code"))
        await bus.request_name("org.freedesktop.systemd1")
        return bus

    with private_bus(bus_dir) as address, served_from_a_thread(serve):
        systemd = Systemd(address, manager, loops[0])
        try:
            yield systemd
        finally:
            systemd.loop.call_soon_threadsafe(manager.release.set)


def two_units(root: Path) -> Config:
    base = demo_config(root)
    return dataclasses.replace(
        base,
        units=(UnitConfig(name=STALLED), UnitConfig(name=OTHER)),
        metrics=dataclasses.replace(base.metrics, enabled=False),
        systemd=SystemdConfig(enabled=True, stop_timeout_s=STOP_TIMEOUT_S, stop_attempts=1),
        tracker=TrackerConfig(settle_s=0),
    )


@contextlib.asynccontextmanager
async def running(config: Config, store: Store, address: str) -> AsyncIterator[Daemon]:
    """The daemon with a real actor on `address`, its gate socket listening, until the end."""
    client = SystemdClient(bus_address=address, timeout_s=30.0)
    metrics = Metrics(new_registry(process=False))
    gates: GateServer | None = None
    halter = Halter(
        Quarantine(quarantine_dir(config)), client, attempts=1, timeout_s=STOP_TIMEOUT_S
    )
    actor = Actor(
        halter, client, metrics, gate_waiting=lambda u: gates is not None and gates.is_waiting(u)
    )
    daemon = compose_daemon(config, load_table(config), store=store, metrics=metrics, actor=actor)
    gates = GateServer(
        socket_path(config.state.runtime_dir),
        ready=daemon.gate_answer,
        released=daemon.released,
        wait_s=30.0,
    )
    config.state.runtime_dir.mkdir(parents=True, exist_ok=True)
    await gates.start()
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        yield daemon
    finally:
        stop.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(task, 20)
        await gates.close()
        await client.close()


def ask_gate(config: Config, unit: str, invocation_id: str) -> tuple[int, str, float]:
    """The unit's gate, as ExecCondition= runs it at the start `invocation_id`; its exit
    status, what it said, and how long it took."""
    out = io.StringIO()
    started = time.monotonic()
    status = gate_main(
        unit,
        config.state.runtime_dir,
        config.state.state_dir,
        wait_s=30.0,
        out=out,
        defaults=(),
        invocation_id=invocation_id,
    )
    return status, out.getvalue(), time.monotonic() - started


def taken(store: Store, unit: str) -> str | None:
    items = [h for h in store.history() if h["unit"] == unit]
    return items[-1]["taken"] if items else None


async def test_a_stalled_stop_holds_neither_another_units_halt_nor_its_gate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While StopUnit of one unit hangs for its whole timeout, another unit's fatal crash is
    quarantined and recorded, and that unit's gate refuses the next start, within seconds."""
    monkeypatch.delenv("INVOCATION_ID", raising=False)
    config = two_units(tmp_path)
    ids = {STALLED: uuid.uuid4().hex, OTHER: uuid.uuid4().hex}
    next_start = uuid.uuid4().hex
    records = Quarantine(quarantine_dir(config))
    store = Store.in_directory(config.state.state_dir)
    loop = asyncio.get_running_loop()
    with (
        systemd_restarting(tmp_path, ids) as systemd,
        JournalWriter(config.journal.directory) as writer,  # type: ignore[arg-type]
    ):
        async with running(config, store, systemd.address) as daemon:
            await poll(lambda: daemon.reader.following.is_set(), within=15, each=writer.nudge)
            writer.write(
                crashed_invocation(STALLED, seed_lines(), restarts=1, invocation_id=ids[STALLED])
            )
            await poll(lambda: systemd.stopped(STALLED), within=15, each=writer.nudge)

            # The other unit crashes the same way while the first StopUnit hangs; systemd
            # starts it again at once, and that start's gate asks the daemon.
            crash = crashed_invocation(OTHER, seed_lines(), restarts=1, invocation_id=ids[OTHER])
            writer.write([*crash, start_entries(OTHER, next_start)[0]])
            written = loop.time()
            gate = asyncio.create_task(asyncio.to_thread(ask_gate, config, OTHER, next_start))
            await poll(
                lambda: records.read(OTHER) is not None and taken(store, OTHER) is not None,
                within=STOP_TIMEOUT_S + 15,
                each=writer.nudge,
            )
            halted_after = loop.time() - written
            status, said, answered_after = await asyncio.wait_for(gate, STOP_TIMEOUT_S + 30)
            still_stalled = taken(store, STALLED) is None
            other_taken = taken(store, OTHER)
    store.close()
    waited = (
        f"{OTHER}'s halt after {halted_after:.2f} s, its gate's answer after {answered_after:.2f} s"
    )
    assert halted_after < PROMPT_S and answered_after < PROMPT_S, f"{waited}: they waited"
    assert still_stalled, f"{STALLED}'s StopUnit was answered: nothing stalled ({waited})"
    assert status == EXIT_QUARANTINED, said
    assert other_taken == Taken.HALTED.value
