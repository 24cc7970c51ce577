"""A reply from systemd with a property of another type is a SystemdError, never a crash.

The properties' types are systemd's D-Bus API, but a Get answers with a variant of any type:
another systemd release, or whatever owns the name on a bus, may send a string where the client
expects bytes or a number. The daemon handles SystemdError everywhere it asks (it decides from
the journal alone); a TypeError or ValueError would end the unit's lane job instead.
No `from __future__ import annotations`: dbus-fast reads the D-Bus signatures from the property
annotations.
"""

# ruff: noqa: F821, F722 - the string annotations are D-Bus signatures, not Python names.

from pathlib import Path

import pytest
from dbus_fast.aio import MessageBus
from dbus_fast.service import PropertyAccess, ServiceInterface, dbus_property, method
from fake_systemd import private_bus

from vllm_supervisor.actions.systemd import SystemdClient
from vllm_supervisor.errors import SystemdError
from vllm_supervisor.model import UnitState

UNIT = "vllm.service"
UNIT_PATH = "/org/freedesktop/systemd1/unit/vllm_2eservice"


class _Manager(ServiceInterface):
    def __init__(self) -> None:
        super().__init__("org.freedesktop.systemd1.Manager")

    @method()
    def LoadUnit(self, name: "s") -> "o":
        return UNIT_PATH


class _OddUnit(ServiceInterface):
    """A unit whose InvocationID is a string and whose ActiveState is a number."""

    def __init__(self) -> None:
        super().__init__("org.freedesktop.systemd1.Unit")

    @dbus_property(access=PropertyAccess.READ)
    def ActiveState(self) -> "i":
        return 3

    @dbus_property(access=PropertyAccess.READ)
    def SubState(self) -> "s":
        return "running"

    @dbus_property(access=PropertyAccess.READ)
    def LoadState(self) -> "s":
        return "loaded"

    @dbus_property(access=PropertyAccess.READ)
    def InvocationID(self) -> "s":
        return "0123456789abcdef0123456789abcdef"

    @dbus_property(access=PropertyAccess.READ)
    def Job(self) -> "s":
        return "7 /org/freedesktop/systemd1/job/7"


class _OddService(ServiceInterface):
    """A service whose numbers are strings and whose ExecCondition is a list of words."""

    def __init__(self, n_restarts: str) -> None:
        super().__init__("org.freedesktop.systemd1.Service")
        self.n_restarts = n_restarts

    @dbus_property(access=PropertyAccess.READ)
    def NRestarts(self) -> "s":
        return self.n_restarts

    @dbus_property(access=PropertyAccess.READ)
    def Result(self) -> "s":
        return "success"

    @dbus_property(access=PropertyAccess.READ)
    def MainPID(self) -> "s":
        return "not a pid"

    @dbus_property(access=PropertyAccess.READ)
    def ExecCondition(self) -> "as":
        return ["vllm-supervisor", "gate"]


@pytest.mark.parametrize("n_restarts", ["3", "three"])
async def test_a_unit_state_of_other_types_is_a_systemd_error(
    tmp_path: Path, n_restarts: str
) -> None:
    """unit_state answers a UnitState or raises SystemdError, whatever the types."""
    with private_bus(tmp_path) as address:
        bus = await MessageBus(bus_address=address).connect()
        bus.export("/org/freedesktop/systemd1", _Manager())
        bus.export(UNIT_PATH, _OddUnit())
        bus.export(UNIT_PATH, _OddService(n_restarts))
        await bus.request_name("org.freedesktop.systemd1")
        client = SystemdClient(bus_address=address, timeout_s=5)
        try:
            state = await client.unit_state(UNIT)
        except SystemdError as exc:
            assert exc.reason == "dbus_error"
        else:
            assert isinstance(state, UnitState)
        finally:
            await client.close()
            bus.disconnect()


async def test_a_job_property_of_another_type_is_a_systemd_error(tmp_path: Path) -> None:
    """pending_job unpacks systemd's (id, path) pair: a string there is a SystemdError, which
    its callers handle, not a ValueError that ends the unit's lane job."""
    with private_bus(tmp_path) as address:
        bus = await MessageBus(bus_address=address).connect()
        bus.export("/org/freedesktop/systemd1", _Manager())
        bus.export(UNIT_PATH, _OddUnit())
        await bus.request_name("org.freedesktop.systemd1")
        client = SystemdClient(bus_address=address, timeout_s=5)
        try:
            with pytest.raises(SystemdError) as raised:
                await client.pending_job(UNIT)
            assert raised.value.reason == "dbus_error"
        finally:
            await client.close()
            bus.disconnect()
