"""Per-unit series of units systemd does not know, under the real daemon and a fake systemd.

The shipped config names sglang.service and tgi.service beside vllm.service; a host has one of
them at most. No `from __future__ import annotations`: dbus-fast reads the D-Bus signatures
from the method annotations at class creation.
"""

# ruff: noqa: F821 - the string annotations of FakeManager are D-Bus signatures.

import asyncio
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from conftest import poll, wait_for
from dbus_fast.aio import MessageBus
from dbus_fast.service import ServiceInterface, method
from fake_systemd import FakeService, FakeUnit, private_bus, served_from_a_thread
from faults.harness import Supervisor, write_config
from test_metrics import parse

from vllm_supervisor.actions.installed import InstalledUnits
from vllm_supervisor.errors import SystemdError
from vllm_supervisor.model import UnitState

ABSENT = "sglang.service"  # in the shipped config; not installed on most hosts
PRESENT = "vllm_supervisor_unit_present[]"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class FakeManager(ServiceInterface):
    """systemd's Manager as 252 answers: LoadUnit gives a path for any name, loaded or not."""

    def __init__(self) -> None:
        super().__init__("org.freedesktop.systemd1.Manager")

    @method()
    def LoadUnit(self, name: "s") -> "o":
        return "/org/freedesktop/systemd1/unit/" + name.replace(".", "_2e")

    @method()
    def Subscribe(self) -> None:
        pass


async def _serve_systemd(address: str) -> MessageBus:
    """vllm.service is loaded and running; sglang.service is LoadState=not-found."""
    bus = await MessageBus(bus_address=address).connect()
    bus.export("/org/freedesktop/systemd1", FakeManager())
    vllm = "/org/freedesktop/systemd1/unit/vllm_2eservice"
    bus.export(vllm, FakeUnit(invocation_id=bytes(16)))
    bus.export(vllm, FakeService(main_pid=4242))
    absent = "/org/freedesktop/systemd1/unit/sglang_2eservice"
    bus.export(absent, FakeUnit(active="inactive", sub="dead", load_state="not-found"))
    bus.export(absent, FakeService())
    await bus.request_name("org.freedesktop.systemd1")
    return bus


def _scrape(sup: Supervisor) -> Samples:
    port = next(e["port"] for e in reversed(sup.events()) if e.get("event") == "metrics_listening")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return parse(response.read().decode())


def _scrape_until(sup: Supervisor, done: Callable[[Samples], bool]) -> Samples:
    """Scrape until `done` holds, for at most 20 s; the last scrape either way."""
    deadline = time.monotonic() + 20
    while not done(samples := _scrape(sup)) and time.monotonic() < deadline:
        time.sleep(0.05)  # a poll interval: `done` decides
    return samples


def _series_of(samples: Samples, unit: str) -> dict[str, float]:
    """The series of one unit label, by metric name (with its other labels)."""
    return {
        name + repr(sorted(k for k in labels if k[0] != "unit")): v
        for (name, labels), v in samples.items()
        if ("unit", unit) in labels
    }


class TestAbsentUnit:
    """A supervised unit systemd does not know exports one series saying so, not ~160."""

    def test_the_daemon_exports_one_series_for_a_unit_systemd_does_not_know(
        self, tmp_path: Path
    ) -> None:
        """The daemon under a fake systemd that knows vllm.service but not sglang.service: the
        absent unit has `unit_present 0` only; the present one has its series at 0."""
        config = write_config(
            tmp_path, systemd="enabled = true\n", extra=f'[[unit]]\nname = "{ABSENT}"\n'
        )
        (tmp_path / "journal").mkdir()
        with (
            private_bus(tmp_path) as address,
            served_from_a_thread(lambda: _serve_systemd(address)),
        ):
            sup = Supervisor(tmp_path, config, env={"DBUS_SYSTEM_BUS_ADDRESS": address})
            sup.start()
            try:
                wait_for(sup.following, what="the supervisor to follow the journal")
                samples = _scrape_until(
                    sup,
                    lambda s: all(PRESENT in _series_of(s, u) for u in (ABSENT, "vllm.service")),
                )
            finally:
                assert sup.terminate() == 0, sup.stderr_text()
        series = _series_of(samples, ABSENT)
        assert len(series) == 1, f"{len(series)} series for {ABSENT}"
        assert series == {PRESENT: 0.0}
        present = _series_of(samples, "vllm.service")
        assert present[PRESENT] == 1.0
        assert present["vllm_supervisor_unit_halted[]"] == 0.0
        assert len(present) > 20  # every per-unit series, at 0 before the first event


class Systemd:
    """Answers unit_state from a dict: "loaded", "not-found", "down" (no bus) or "garbled"."""

    def __init__(self, units: dict[str, str]) -> None:
        self.units = units
        self.asked: list[str] = []

    async def unit_state(self, unit: str) -> UnitState:
        self.asked.append(unit)
        answer = self.units.get(unit, "not-found")
        if answer == "not-found":
            raise SystemdError(f"{unit}: no such unit", reason="no_such_unit", retryable=False)
        if answer == "down":
            raise SystemdError("no bus", reason="bus_unavailable", retryable=True)
        if answer == "garbled":
            raise KeyError("InvocationID")
        return UnitState(
            active_state="active", sub_state="running", n_restarts=0, result="success",
            invocation_id="", main_pid=1,
        )  # fmt: skip

    async def exec_start(self, unit: str) -> list[str]:
        return []


class TestInstalledUnits:
    """Which supervised units systemd has: asked once each, again only while not known."""

    @staticmethod
    async def _running(installed: InstalledUnits, until: Callable[[], bool]) -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(installed.run(stop))
        try:
            await poll(until)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)

    async def test_each_unit_is_reported_as_systemd_answers(self) -> None:
        """Loaded -> True, no such unit -> False, no answer or a garbled one -> None."""
        systemd = Systemd({"a.service": "loaded", "c.service": "down", "d.service": "garbled"})
        names = ["a.service", "b.service", "c.service", "d.service"]
        reports: dict[str, bool | None] = {}
        installed = InstalledUnits(systemd, lambda: names, reports.__setitem__)
        await self._running(installed, lambda: len(reports) == 4)
        assert reports == {
            "a.service": True, "b.service": False, "c.service": None, "d.service": None
        }  # fmt: skip

    async def test_a_change_asks_again_only_about_a_unit_not_known_to_exist(self) -> None:
        """systemd announcing a change of an absent unit (installed, started) asks again; one
        of a unit known to exist costs no call."""
        systemd = Systemd({"a.service": "loaded"})
        reports: list[tuple[str, bool | None]] = []
        installed = InstalledUnits(
            systemd, lambda: ["a.service", "b.service"], lambda *r: reports.append(r)
        )
        stop = asyncio.Event()
        task = asyncio.create_task(installed.run(stop))
        try:
            await poll(lambda: len(reports) == 2)
            systemd.units["b.service"] = "loaded"
            installed.changed("a.service")
            installed.changed("b.service")
            await poll(lambda: len(reports) == 3)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
        assert reports[2] == ("b.service", True)
        assert systemd.asked == ["a.service", "b.service", "b.service"]

    async def test_a_unit_configured_since_is_asked_at_the_next_wake(self) -> None:
        """A reload adds a unit: the next scrape's wake asks about it, and only it."""
        systemd = Systemd({"a.service": "loaded", "b.service": "loaded"})
        names = ["a.service"]
        reports: dict[str, bool | None] = {}
        installed = InstalledUnits(systemd, lambda: names, reports.__setitem__)
        stop = asyncio.Event()
        task = asyncio.create_task(installed.run(stop))
        try:
            await poll(lambda: "a.service" in reports)
            installed.wake()  # nothing new: no call
            names.append("b.service")
            installed.wake()
            await poll(lambda: "b.service" in reports)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
        assert systemd.asked == ["a.service", "b.service"]

    async def test_without_systemd_nothing_is_called_absent(self) -> None:
        """systemd not used: every unit is reported unknown, so it keeps all its series."""
        reports: dict[str, bool | None] = {}
        installed = InstalledUnits(None, lambda: ["a.service"], reports.__setitem__)
        await self._running(installed, lambda: bool(reports))
        assert reports == {"a.service": None}
