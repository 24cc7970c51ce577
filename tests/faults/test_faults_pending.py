"""An action decided and not yet taken survives a kill of the supervisor, and is taken once.

The batch that decides a halt commits its cursor with the halt pending; the halt is carried out
after, in its unit's lane. A SIGKILL in between (here: while systemd stalls the StopUnit) must
lose nothing: the next run finds the halt pending, carries it out, records it once and tells it
once. systemd is a fake on a real private dbus-daemon; the supervisor is a real
`vllm-supervisor run` child on a real journal.
"""

# ruff: noqa: F821 - the string annotations are D-Bus signatures, not Python names.

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

from conftest import wait_for
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface, method
from fake_systemd import FakeService, FakeUnit, private_bus, served_from_a_thread
from slack_server import SlackServer

from faults.harness import UNIT, Supervisor, crash, db_rows, history_cli, write_config
from vllm_supervisor.journal.writer import JournalWriter
from vllm_supervisor.model import Taken

INVOCATION = f"{1:032x}"  # faults.harness.crash's id for serial 1
SYSTEMD = "enabled = true\nstop_attempts = 1\nstop_timeout_s = 60.0\n"


class Manager(ServiceInterface):
    """LoadUnit, Subscribe and StopUnit; StopUnit does not answer until `released` is set."""

    def __init__(self) -> None:
        super().__init__("org.freedesktop.systemd1.Manager")
        self.released = threading.Event()  # set from the test's thread
        self.stops: list[str] = []

    @method()
    def LoadUnit(self, name: "s") -> "o":
        return "/org/freedesktop/systemd1/unit/vllm_2eservice"

    @method()
    def Subscribe(self) -> None:
        pass

    @method()
    async def StopUnit(self, name: "s", mode: "s") -> "o":
        self.stops.append(name)
        await asyncio.to_thread(self.released.wait)
        return "/org/freedesktop/systemd1/job/1"


@contextlib.contextmanager
def systemd_restarting(tmp_path: Path) -> Iterator[tuple[str, Manager]]:
    """A systemd whose unit waits in auto-restart after the crash INVOCATION."""
    bus_dir = tmp_path / "bus"
    bus_dir.mkdir()
    manager = Manager()

    async def serve() -> MessageBus:
        bus = await MessageBus(bus_address=address).connect()
        bus.export("/org/freedesktop/systemd1", manager)
        state = FakeUnit(active="activating", sub="auto-restart")
        state.invocation_id = bytes.fromhex(INVOCATION)
        bus.export("/org/freedesktop/systemd1/unit/vllm_2eservice", state)
        bus.export(
            "/org/freedesktop/systemd1/unit/vllm_2eservice",
            FakeService(n_restarts=1, result="exit-code"),
        )
        await bus.request_name("org.freedesktop.systemd1")
        return bus

    with private_bus(bus_dir) as address, served_from_a_thread(serve):
        try:
            yield address, manager
        finally:
            manager.released.set()


def test_a_kill_between_a_halts_decision_and_its_stop_loses_and_repeats_nothing(
    tmp_path: Path, slack: SlackServer, supervisors: list[Supervisor]
) -> None:
    """Killed while StopUnit stalls: the next run finds the halt pending, stops the unit, and
    records and announces the crash once."""
    config = write_config(tmp_path, slack_url=slack.url, systemd=SYSTEMD)
    (tmp_path / "journal").mkdir()
    with (
        systemd_restarting(tmp_path) as (address, manager),
        JournalWriter(tmp_path / "journal") as writer,
    ):
        sup = Supervisor(tmp_path, config, env={"DBUS_SYSTEM_BUS_ADDRESS": address})
        supervisors.append(sup)
        writer.write(crash("fatal", 1))
        sup.start()
        state = tmp_path / "state"
        wait_for(lambda: manager.stops, what="the first run's StopUnit")
        pending = "SELECT unit, key FROM pending_action"
        wait_for(lambda: db_rows(state, pending), what="the halt committed as pending")
        sup.kill9()
        assert db_rows(state, pending) == [(UNIT, INVOCATION)]
        assert db_rows(state, "SELECT count(*) FROM history") == [(0,)]

        manager.released.set()
        sup.start()
        wait_for(
            lambda: db_rows(state, "SELECT notified FROM history") == [(1,)],
            what="the halt taken, recorded and announced by the second run",
        )
        assert sup.terminate() == 0, sup.stderr_text()
    (item,) = history_cli(state)
    assert (item["invocation_id"], item["taken"]) == (INVOCATION, Taken.HALTED.value)
    assert db_rows(state, pending) == []
    assert manager.stops == [UNIT, UNIT]  # once per run: the second run carried it out
    assert (tmp_path / "run" / "quarantine" / f"{UNIT}.json").exists()
    assert len(slack.requests) == 1
    resumed = [e for e in sup.events() if e.get("event") == "pending_action_resumed"]
    assert [(e["unit"], e["invocation_id"]) for e in resumed] == [(UNIT, INVOCATION)]
