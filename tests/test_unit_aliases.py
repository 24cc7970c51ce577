"""A configured name that is an alias is supervised under the unit's real name (issue 22, 6).

Seen before on systemd 252: the config named `llm.service`, an `Alias=` of `vllm.service`. The
journal carries only the real name (`_SYSTEMD_UNIT`, PID 1's `UNIT=`), so the daemon never
decided a crash; setup wrote the gate under the alias and `llm.service` into the polkit rule,
which polkit never matches (it is asked about the real name). Now the daemon, setup and
check-config ask systemd for each unit's `Id` and `Names`.

A fake systemd (real dbus-daemon, tests/fake_systemd.py) answers LoadUnit with the real
unit's object path for an alias, as systemd does. No `from __future__ import annotations`:
dbus-fast reads the D-Bus signatures from the annotations.
"""

# ruff: noqa: F821, F722 - the string annotations are D-Bus signatures, not Python names.

import argparse
import asyncio
import dataclasses
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import structlog.testing
from conftest import poll
from dbus_fast.aio import MessageBus
from dbus_fast.service import PropertyAccess, ServiceInterface, dbus_property, method
from fake_systemd import FakeService, FakeUnit, private_bus, served_from_a_thread
from hypothesis import given
from hypothesis import strategies as st
from test_setup_safety import Host, host, warnings, write_config

from vllm_supervisor.actions.actor import Actor
from vllm_supervisor.actions.halt import Halter
from vllm_supervisor.actions.quarantine import Quarantine, quarantine_dir
from vllm_supervisor.actions.systemd import SystemdClient
from vllm_supervisor.actions.unitnames import RealNames, ask_names, under_real_names
from vllm_supervisor.app import compose_daemon
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands import gate, setup
from vllm_supervisor.commands.demo import demo_config, seed_lines
from vllm_supervisor.config import Config, UnitConfig, load_config
from vllm_supervisor.daemon import Daemon
from vllm_supervisor.errors import SystemdError
from vllm_supervisor.journal.writer import JournalWriter, crashed_invocation
from vllm_supervisor.store import Store
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

__all__ = ["host"]  # the fixture, used by name

REAL, ALIAS, OTHER, MISSING = "vllm.service", "llm.service", "other.service", "missing.service"
UNIT_PATHS = "/org/freedesktop/systemd1/unit/"
PATHS = {
    REAL: UNIT_PATHS + "vllm_2eservice",
    ALIAS: UNIT_PATHS + "vllm_2eservice",  # LoadUnit of an alias answers with its unit
    OTHER: UNIT_PATHS + "other_2eservice",
}
NOT_FOUND_PATH = UNIT_PATHS + "missing_2eservice"


class NamedUnit(FakeUnit):
    """A unit that also says its real name (Id) and every name it goes by (Names)."""

    def __init__(self, unit_id: str, *aliases: str, load_state: str = "loaded") -> None:
        super().__init__(load_state=load_state)
        self.unit_id, self.names = unit_id, [unit_id, *aliases]

    @dbus_property(access=PropertyAccess.READ)
    def Id(self) -> "s":
        return self.unit_id

    @dbus_property(access=PropertyAccess.READ)
    def Names(self) -> "as":
        return self.names


class AliasingManager(ServiceInterface):
    """Manager.LoadUnit as systemd answers it: an alias gives its unit's path, a name no
    unit file has a path whose unit is `not-found`."""

    def __init__(self) -> None:
        super().__init__("org.freedesktop.systemd1.Manager")
        self.asked: list[str] = []

    @method()
    def LoadUnit(self, name: "s") -> "o":
        self.asked.append(name)
        return PATHS.get(name, NOT_FOUND_PATH)


async def serve_systemd(address: str) -> MessageBus:
    """vllm.service (alias llm.service), other.service, and nothing for missing.service."""
    bus = await MessageBus(bus_address=address).connect()
    bus.export("/org/freedesktop/systemd1", AliasingManager())
    bus.export(PATHS[REAL], NamedUnit(REAL, ALIAS))
    bus.export(PATHS[REAL], FakeService())
    bus.export(PATHS[OTHER], NamedUnit(OTHER))
    bus.export(NOT_FOUND_PATH, NamedUnit(MISSING, load_state="not-found"))
    await bus.request_name("org.freedesktop.systemd1")
    return bus


@pytest.fixture(name="bus_address")
def _bus_address(tmp_path: Path) -> Iterator[str]:
    with private_bus(tmp_path) as address:
        yield address


@pytest.fixture(name="systemd")
async def _systemd(bus_address: str) -> AsyncIterator[SystemdClient]:
    """A client of the fake systemd, which is served on this test's event loop."""
    bus = await serve_systemd(bus_address)
    client = SystemdClient(bus_address=bus_address, timeout_s=2.0)
    yield client
    await client.close()
    bus.disconnect()


@pytest.fixture(name="systemd_in_a_thread")
def _systemd_in_a_thread(bus_address: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The fake systemd as the system bus, served from a thread while a synchronous command
    (setup, check-config) runs its own event loop."""
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", bus_address)
    with served_from_a_thread(lambda: serve_systemd(bus_address)):
        yield bus_address


def unit(name: str, **settings: object) -> UnitConfig:
    return UnitConfig(name=name, **settings)  # type: ignore[arg-type]


def config_of(root: Path, *units: UnitConfig) -> Config:
    base = demo_config(root)
    return dataclasses.replace(
        base, units=units, metrics=dataclasses.replace(base.metrics, enabled=False)
    )


# --- what systemd says -------------------------------------------------------------------


async def test_an_alias_answers_with_the_real_name_and_every_name(
    systemd: SystemdClient,
) -> None:
    """LoadUnit resolves the alias; the unit's Id is its real name, Names holds both."""
    assert await systemd.unit_names(ALIAS) == (REAL, (REAL, ALIAS))
    assert await systemd.unit_names(REAL) == (REAL, (REAL, ALIAS))
    assert await systemd.unit_names(OTHER) == (OTHER, (OTHER,))


async def test_a_name_systemd_does_not_know_is_no_such_unit(systemd: SystemdClient) -> None:
    """systemd answers LoadUnit for any name; LoadState=not-found says there is no unit."""
    with pytest.raises(SystemdError) as info:
        await systemd.unit_names(MISSING)
    assert info.value.reason == "no_such_unit"


# --- the daemon's resolution ---------------------------------------------------------------


async def test_an_alias_is_followed_under_the_real_name_with_its_settings(
    systemd: SystemdClient, tmp_path: Path
) -> None:
    """The configured settings stay attached; one line says what is followed instead."""
    names = RealNames(systemd)
    configured = unit(ALIAS, unknown_repeat_limit=5, health_url="http://127.0.0.1:8000/health")
    with structlog.testing.capture_logs() as logs:
        config = await names.resolve(config_of(tmp_path, configured, unit(OTHER)))
    assert config.units == (dataclasses.replace(configured, name=REAL), unit(OTHER))
    [said] = [e for e in logs if e["event"] == "unit_is_an_alias"]
    assert said["detail"] == f"{ALIAS} is an alias of {REAL}: following {REAL}"
    assert (said["unit"], said["real_name"]) == (ALIAS, REAL)
    assert [e["event"] for e in logs] == ["unit_is_an_alias"]
    assert (names.real_name(ALIAS), names.real_name(REAL)) == (REAL, REAL)
    assert names.real_name("unrelated.service") == "unrelated.service"


async def test_a_name_systemd_does_not_know_stays_with_a_warning(
    systemd: SystemdClient, tmp_path: Path
) -> None:
    with structlog.testing.capture_logs() as logs:
        config = await RealNames(systemd).resolve(config_of(tmp_path, unit(MISSING), unit(ALIAS)))
    assert [u.name for u in config.units] == [MISSING, REAL]
    [warned] = [e for e in logs if e["event"] == "unit_not_found"]
    assert warned["unit"] == MISSING and warned["log_level"] == "warning"


async def test_systemd_unreachable_keeps_the_names_as_configured(tmp_path: Path) -> None:
    """No bus: the names stay as configured, said once, without waiting per unit."""
    client = SystemdClient(bus_address=f"unix:path={tmp_path}/no-bus", timeout_s=2.0)
    configured = config_of(tmp_path, unit(ALIAS), unit(OTHER), unit(MISSING))
    started = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        config = await RealNames(client).resolve(configured)
    assert time.monotonic() - started < 2.0
    assert config == configured
    assert [e["event"] for e in logs] == ["unit_names_unresolved"]
    assert "system bus" in logs[0]["error"]


async def test_no_systemd_to_ask_changes_nothing(tmp_path: Path) -> None:
    """A journal directory or `[systemd] enabled = false`: nothing is asked, nothing said."""
    configured = config_of(tmp_path, unit(ALIAS))
    with structlog.testing.capture_logs() as logs:
        assert await RealNames(None).resolve(configured) == configured
    assert logs == []


async def test_a_reload_without_systemd_keeps_what_systemd_said_before(
    bus_address: str, tmp_path: Path
) -> None:
    """systemd went away after the start: a reload still follows the real name it gave."""
    bus = await serve_systemd(bus_address)
    client = SystemdClient(bus_address=bus_address, timeout_s=1.0)
    names = RealNames(client)
    configured = config_of(tmp_path, unit(ALIAS), unit(OTHER))
    assert [u.name for u in (await names.resolve(configured)).units] == [REAL, OTHER]
    bus.disconnect()  # systemd's name has no owner any more: LoadUnit fails
    with structlog.testing.capture_logs() as logs:
        again = await names.resolve(configured)
    await client.close()
    assert [u.name for u in again.units] == [REAL, OTHER]
    assert "unit_names_unresolved" in [e["event"] for e in logs]
    assert names.real_name(ALIAS) == REAL


async def test_an_alias_and_its_unit_both_listed_are_one_unit(
    systemd: SystemdClient, tmp_path: Path
) -> None:
    """The entry that names the real unit keeps its settings; the alias entry is named."""
    listed = config_of(tmp_path, unit(ALIAS, unknown_repeat_limit=7), unit(REAL, dry_run=True))
    with structlog.testing.capture_logs() as logs:
        config = await RealNames(systemd).resolve(listed)
    assert config.units == (unit(REAL, dry_run=True),)
    [twice] = [e for e in logs if e["event"] == "unit_listed_twice"]
    assert (twice["unit"], twice["real_name"]) == (ALIAS, REAL)


NAMES = st.sampled_from([f"u{i}.service" for i in range(8)])


@given(
    configured=st.lists(NAMES, unique=True, max_size=8),
    real=st.dictionaries(NAMES, NAMES, max_size=8),
    limits=st.lists(st.integers(1, 9), min_size=8, max_size=8),
)
def test_renaming_keeps_one_entry_per_real_unit_with_configured_settings(
    configured: list[str], real: dict[str, str], limits: list[int]
) -> None:
    """Any config and any answer of systemd: one entry per real unit, in config order, each
    with the settings of an entry naming it (that naming the Id itself when there is one);
    every entry left out is named with the one kept."""
    units = [unit(n, unknown_repeat_limit=limits[i]) for i, n in enumerate(configured)]
    renamed, dropped = under_real_names(units, real)
    real_of = {u.name: real.get(u.name, u.name) for u in units}
    assert [u.name for u in renamed] == list(dict.fromkeys(real_of.values()))
    for kept in renamed:
        sources = [u for u in units if real_of[u.name] == kept.name]
        naming_the_id = [u for u in sources if u.name == kept.name]
        source = (naming_the_id or sources)[0]
        assert kept == dataclasses.replace(source, name=kept.name)
    assert len(renamed) + len(dropped) == len(units)
    for name, kept_name in dropped.items():
        assert real_of[name] == real_of[kept_name] and kept_name != name


class SilentManager(ServiceInterface):
    """A systemd that never answers LoadUnit (frozen, or too busy to)."""

    def __init__(self) -> None:
        super().__init__("org.freedesktop.systemd1.Manager")
        self.never = asyncio.Event()

    @method()
    async def LoadUnit(self, name: "s") -> "o":
        await self.never.wait()
        return NOT_FOUND_PATH


async def test_asking_stops_at_the_first_failure_that_is_not_a_missing_unit(
    bus_address: str,
) -> None:
    """A systemd that does not answer is asked once, not once per unit: each try waits the
    whole timeout (1 s here), so three units would hold the daemon's start 3 s."""
    bus = await serve_systemd(bus_address)
    client = SystemdClient(bus_address=bus_address, timeout_s=1.0)
    found = await ask_names(client, [MISSING, ALIAS])
    bus.disconnect()
    silent = await MessageBus(bus_address=bus_address).connect()
    manager = SilentManager()
    silent.export("/org/freedesktop/systemd1", manager)
    await silent.request_name("org.freedesktop.systemd1")
    started = time.monotonic()
    later = await ask_names(client, [OTHER, ALIAS, MISSING])
    took = time.monotonic() - started
    manager.never.set()
    await client.close()
    silent.disconnect()
    assert (found.real, found.not_found, found.trouble) == ({ALIAS: REAL}, (MISSING,), None)
    assert found.aliases() == {ALIAS: REAL}
    assert later.real == {} and later.not_found == ()
    assert "no answer in time" in str(later.trouble)
    assert 1.0 <= took < 2.5, took


# --- the daemon: gate and decisions under the real name -------------------------------------


def build_daemon(config: Config, store: Store, names: RealNames) -> Daemon:
    halter = Halter(Quarantine(quarantine_dir(config)), None, attempts=1, timeout_s=1)
    metrics = Metrics(new_registry(process=False))
    return compose_daemon(
        config,
        load_table(config),
        store=store,
        metrics=metrics,
        actor=Actor(halter, None, metrics),
        load_config=lambda: config,
        names=names,
    )


async def test_a_gate_sending_any_name_of_a_supervised_unit_is_supervised(
    systemd: SystemdClient, tmp_path: Path
) -> None:
    """The gate's %n is the real name; a gate asked by the alias is the same unit."""
    names = RealNames(systemd)
    config = await names.resolve(config_of(tmp_path, unit(ALIAS)))
    store = Store.in_directory(config.state.state_dir)
    daemon = build_daemon(config, store, names)
    try:
        for name in (REAL, ALIAS):
            answer = await asyncio.wait_for(daemon.gate_answer(name, None, 5.0), 5.0)
            assert answer == {"ok": True, "decided": True}, name
        other = await asyncio.wait_for(daemon.gate_answer(OTHER, None, 5.0), 5.0)
        assert other["supervised"] is False
    finally:
        store.close()


async def test_a_reload_to_an_alias_halts_the_real_units_crash(
    systemd: SystemdClient, tmp_path: Path
) -> None:
    """Started supervising other.service; reloaded with a config naming llm.service: the
    daemon follows vllm.service and halts its fatal crash on a real journal."""
    started = config_of(tmp_path, unit(OTHER))
    reloaded = config_of(tmp_path, unit(ALIAS))
    names = RealNames(systemd)
    store = Store.in_directory(started.state.state_dir)
    halter = Halter(Quarantine(quarantine_dir(started)), None, attempts=1, timeout_s=1)
    metrics = Metrics(new_registry(process=False))
    daemon = compose_daemon(
        await names.resolve(started),
        load_table(started),
        store=store,
        metrics=metrics,
        actor=Actor(halter, None, metrics),
        load_config=lambda: reloaded,
        names=names,
    )
    stop, reload = asyncio.Event(), asyncio.Event()
    crash = crashed_invocation(REAL, seed_lines(), restarts=1, invocation_id=uuid.uuid4().hex)
    with JournalWriter(started.journal.directory) as writer:  # type: ignore[arg-type]
        writer.write(crashed_invocation(OTHER, ["starting"], exit_status=0))
        task = asyncio.create_task(daemon.run(stop, reload))
        try:
            await poll(lambda: daemon.reader.following.is_set(), within=15, each=writer.nudge)
            reload.set()
            await poll(lambda: [u.name for u in daemon.config.units] == [REAL], within=10)
            writer.write(crash)
            await poll(
                lambda: (quarantine_dir(started) / REAL).with_suffix(".service.json").exists(),
                within=15,
                each=writer.nudge,
            )
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
    [halted] = [i for i in store.history() if i["unit"] == REAL]
    store.close()
    assert (halted["decision"]["action"], halted["verdict"]["signature"]) == (
        "halt",
        "flashinfer_cubin_mismatch",
    )


# --- setup and check-config ---------------------------------------------------------------


def test_setup_gates_and_permits_the_real_unit_of_an_alias(
    host: Host, systemd_in_a_thread: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the drop-in went to llm.service.d/ and the polkit rule named llm.service
    (polkit is asked about vllm.service: every stop refused). Now both are the real unit's,
    an older setup's gate under the alias is removed, and setup says why."""
    write_config(host.config, units=(ALIAS, OTHER))
    unit_dir = host.target("UNIT_DIR")
    old = unit_dir / f"{ALIAS}.d" / setup.DROP_IN
    old.parent.mkdir(parents=True)
    old.write_text(f"# {setup.MARKER.removeprefix('# ')}\n[Unit]\n")
    out = host.install()
    assert (unit_dir / f"{REAL}.d" / setup.DROP_IN).is_file()
    assert (unit_dir / f"{OTHER}.d" / setup.DROP_IN).is_file()
    assert not old.exists() and not old.parent.exists()
    assert f"removed   {old}" in out
    assert out.endswith(f"supervising {REAL}, {OTHER}\n"), out
    rule = host.target("POLKIT_FILE").read_text()
    assert f'var SUPERVISED_UNITS = ["{OTHER}", "{REAL}"]' in rule
    [said] = warnings(capsys.readouterr().err)
    assert f"{ALIAS} is an alias of {REAL}" in said and f"{REAL}.d/" in said


def test_setup_leaves_an_alias_drop_in_it_did_not_write(
    host: Host, systemd_in_a_thread: str
) -> None:
    """A person's own drop-in under the alias's name is theirs: setup never removes it."""
    write_config(host.config, units=(ALIAS,))
    theirs = host.target("UNIT_DIR") / f"{ALIAS}.d" / setup.DROP_IN
    theirs.parent.mkdir(parents=True)
    theirs.write_text("[Service]\nEnvironment=MINE=1\n")
    host.install()
    assert theirs.read_text() == "[Service]\nEnvironment=MINE=1\n"


def check_config(config: Path, bus_address: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DBUS_SYSTEM_BUS_ADDRESS": bus_address}
    return subprocess.run(
        [sys.executable, "-m", "vllm_supervisor", "check-config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def test_check_config_says_a_name_is_an_alias(systemd_in_a_thread: str, tmp_path: Path) -> None:
    config = write_config(tmp_path / "vs.toml", units=(ALIAS, OTHER))
    done = check_config(config, systemd_in_a_thread)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "alias" in line]
    assert len(said) == 1 and said[0].startswith(f"warning: {ALIAS} is an alias of {REAL}")


def test_check_config_looks_for_an_aliass_gate_under_the_real_name(
    systemd_in_a_thread: str, tmp_path: Path
) -> None:
    """The drop-in of an aliased unit is looked for in the real unit's directory."""
    config = write_config(tmp_path / "vs.toml", units=(ALIAS,))
    for name in (ALIAS, REAL):
        gate = tmp_path / "root" / "etc/systemd/system" / f"{name}.d" / setup.DROP_IN
        gate.parent.mkdir(parents=True)
        gate.touch()
        loaded = load_config(config)
        found = setup.missing_drop_ins(loaded, tmp_path / "root", real_names={ALIAS: REAL})
        assert found == ([ALIAS] if name == ALIAS else []), name
        gate.unlink()
    # With systemd to ask, what it loaded decides: its ExecCondition= (here: none) runs no gate.
    said = check_config(config, systemd_in_a_thread).stderr
    assert f"systemd runs no vllm-supervisor gate for {ALIAS}" in said, said


def test_the_gate_asked_by_an_alias_refuses_the_real_units_halt(
    systemd_in_a_thread: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A gate written with the alias (`gate llm.service`, by hand or by an older setup) reads
    the record filed under the real name: a start by any name of a halted unit is refused."""
    runtime, state = tmp_path / "run", tmp_path / "state"
    Quarantine(runtime / "quarantine").write(
        REAL, {"signature": "flashinfer_cubin_mismatch", "reason": "fatal"}
    )
    args = argparse.Namespace(
        unit=ALIAS,
        config=tmp_path / "absent.toml",
        runtime_dir=runtime,
        state_dir=state,
        supervisor_unit="vllm-supervisor.service",
    )
    assert gate.main(args) == gate.EXIT_QUARANTINED
    said = capsys.readouterr().err
    assert f"{ALIAS} is {REAL}" in said, said
    assert "flashinfer_cubin_mismatch" in said
    assert f"vllm-supervisor release {REAL}" in said
