"""An asyncio client for systemd's D-Bus API: stop and restart units, read their state.

This is the only module that talks to PID 1. Every dbus-fast error, OSError and timeout is
translated here into `SystemdError` with a bounded `reason` label (used as a metric label) and a
`retryable` flag, so callers never see library exceptions. Calls are plain method-call messages
(no introspection round trip), each bounded by `timeout_s`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Final, TypeVar

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.errors import AuthError, DBusError, DBusFastError, InvalidAddressError

from ..errors import SystemdError
from ..model import UnitState

T = TypeVar("T")

SYSTEMD_BUS_NAME: Final = "org.freedesktop.systemd1"
MANAGER_PATH: Final = "/org/freedesktop/systemd1"
MANAGER_IFACE: Final = "org.freedesktop.systemd1.Manager"
UNIT_IFACE: Final = "org.freedesktop.systemd1.Unit"
JOB_IFACE: Final = "org.freedesktop.systemd1.Job"
SERVICE_IFACE: Final = "org.freedesktop.systemd1.Service"
PROPS_IFACE: Final = "org.freedesktop.DBus.Properties"
# The unit types that run processes as a user carry a UID property (read on systemd 252).
_UID_IFACES: Final[Mapping[str, str]] = {
    kind: f"org.freedesktop.systemd1.{kind.capitalize()}"
    for kind in ("service", "socket", "mount", "swap")
}
_UID_INVALID: Final = 0xFFFFFFFF  # "[not set]"

# D-Bus error names -> (reason label, retryable). Everything else is ("dbus_error", False).
_ERROR_MAP: Final[Mapping[str, tuple[str, bool]]] = {
    "org.freedesktop.DBus.Error.ServiceUnknown": ("bus_unavailable", True),
    "org.freedesktop.DBus.Error.NameHasNoOwner": ("bus_unavailable", True),
    "org.freedesktop.DBus.Error.Disconnected": ("bus_unavailable", True),
    "org.freedesktop.DBus.Error.NoServer": ("bus_unavailable", True),
    "org.freedesktop.DBus.Error.AccessDenied": ("access_denied", False),
    "org.freedesktop.DBus.Error.AuthFailed": ("access_denied", False),
    "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired": ("access_denied", False),
    "org.freedesktop.systemd1.NoSuchUnit": ("no_such_unit", False),
    "org.freedesktop.systemd1.LoadFailed": ("no_such_unit", False),
    "org.freedesktop.systemd1.UnitExists": ("unit_exists", False),
    "org.freedesktop.DBus.Error.NoReply": ("timeout", True),
    "org.freedesktop.DBus.Error.Timeout": ("timeout", True),
    "org.freedesktop.DBus.Error.TimedOut": ("timeout", True),
    "org.freedesktop.DBus.Error.LimitsExceeded": ("dbus_error", True),
    "org.freedesktop.DBus.Error.NoMemory": ("dbus_error", True),
}


def map_dbus_error(exc: BaseException, what: str) -> SystemdError:
    """Translate a dbus-fast, OS or timeout failure of `what` into a SystemdError."""
    if isinstance(exc, DBusError):
        reason, retryable = _ERROR_MAP.get(exc.type, ("dbus_error", False))
        return SystemdError(f"{what}: {exc.type}: {exc.text}", reason=reason, retryable=retryable)
    if isinstance(exc, TimeoutError):
        return SystemdError(f"{what}: no answer in time", reason="timeout", retryable=True)
    if isinstance(exc, PermissionError | AuthError):
        return SystemdError(f"{what}: {exc}", reason="access_denied", retryable=False)
    if isinstance(exc, InvalidAddressError):
        return SystemdError(
            f"{what}: bad bus address: {exc}", reason="bus_unavailable", retryable=False
        )
    if isinstance(exc, OSError | EOFError | DBusFastError):
        return SystemdError(f"{what}: {exc!r}", reason="bus_unavailable", retryable=True)
    return SystemdError(f"{what}: {exc!r}", reason="dbus_error", retryable=False)


class SystemdClient:
    """Talks to systemd over the system bus (or `bus_address`, e.g. a test bus)."""

    def __init__(self, *, bus_address: str | None = None, timeout_s: float = 10.0) -> None:
        self._address = bus_address or os.environ.get("DBUS_SYSTEM_BUS_ADDRESS")
        self._timeout_s = timeout_s
        self._bus: MessageBus | None = None

    async def connect(self) -> None:
        """Open the bus connection; a no-op when it is already open."""
        if self._bus is not None and self._bus.connected:
            return
        try:
            async with asyncio.timeout(self._timeout_s):
                bus = MessageBus(bus_address=self._address, bus_type=BusType.SYSTEM)
                self._bus = await bus.connect()
        except (DBusFastError, OSError, EOFError, TimeoutError) as exc:
            raise map_dbus_error(exc, "connect to the system bus") from exc

    async def close(self) -> None:
        """Close the bus connection (idempotent)."""
        bus, self._bus = self._bus, None
        if bus is not None:
            bus.disconnect()
            try:
                async with asyncio.timeout(self._timeout_s):
                    await bus.wait_for_disconnect()  # type: ignore[no-untyped-call]
            except (TimeoutError, OSError, EOFError, DBusFastError):
                pass  # Closing is best effort; the socket is gone either way.

    async def stop_unit(self, unit: str) -> str:
        """Stop `unit` (job mode "replace", which also cancels a pending restart); the job path."""
        body = await self._call(MANAGER_PATH, MANAGER_IFACE, "StopUnit", "ss", [unit, "replace"])
        return str(body[0])

    async def restart_unit(self, unit: str) -> str:
        """Restart `unit` (job mode "replace"); the job path."""
        body = await self._call(MANAGER_PATH, MANAGER_IFACE, "RestartUnit", "ss", [unit, "replace"])
        return str(body[0])

    async def start_unit(self, unit: str) -> str:
        """Start `unit` (job mode "replace"); the job path."""
        body = await self._call(MANAGER_PATH, MANAGER_IFACE, "StartUnit", "ss", [unit, "replace"])
        return str(body[0])

    async def start_transient_timer(
        self, name: str, *, description: str, on_calendar: str, argv: Sequence[str]
    ) -> str:
        """Start the transient timer `name` (".timer") that fires once at `on_calendar` and
        runs `argv` as root in the transient service of the same name (a timer triggers its
        own name's service; a transient one can name no other). Both go away once done. The job
        path; `unit_exists` when a unit of that name is loaded already."""
        service = name.removesuffix(".timer") + ".service"
        timer_props = [
            ("Description", Variant("s", description)),
            ("TimersCalendar", Variant("a(ss)", [("OnCalendar", on_calendar)])),
            # Not the default minute: a start held until 10:42:00 comes at 10:42:00.
            ("AccuracyUSec", Variant("t", 1_000_000)),
            ("RemainAfterElapse", Variant("b", False)),
            ("Persistent", Variant("b", False)),
        ]
        service_props = [
            ("Description", Variant("s", description)),
            ("Type", Variant("s", "oneshot")),
            ("ExecStart", Variant("a(sasb)", [(argv[0], list(argv), False)])),
        ]
        body = await self._call(
            MANAGER_PATH,
            MANAGER_IFACE,
            "StartTransientUnit",
            "ssa(sv)a(sa(sv))",
            [name, "fail", timer_props, [(service, service_props)]],
        )
        return str(body[0])

    async def units_matching(self, patterns: Sequence[str]) -> list[str]:
        """The names of the loaded units that match the shell `patterns`."""
        body = await self._call(
            MANAGER_PATH, MANAGER_IFACE, "ListUnitsByPatterns", "asas", [[], list(patterns)]
        )
        try:
            return [str(row[0]) for row in body[0]]
        except (TypeError, IndexError) as exc:
            raise SystemdError(
                f"ListUnitsByPatterns: unexpected reply: {exc}",
                reason="dbus_error",
                retryable=False,
            ) from exc

    async def unit_state(self, unit: str) -> UnitState:
        """The unit's current state; `no_such_unit` when systemd knows no such unit file."""
        path = await self._unit_path(unit)
        props = await self._get_all(path, UNIT_IFACE)
        if props.get("LoadState") == "not-found":
            raise SystemdError(f"{unit}: no such unit", reason="no_such_unit", retryable=False)
        service = await self._get_all(path, SERVICE_IFACE) if unit.endswith(".service") else {}
        try:
            return UnitState(
                active_state=str(props.get("ActiveState", "")),
                sub_state=str(props.get("SubState", "")),
                load_state=str(props.get("LoadState", "")),
                invocation_id=bytes(props.get("InvocationID", b"")).hex(),
                n_restarts=int(service.get("NRestarts", 0)),
                result=str(service.get("Result", "")),
                main_pid=int(service.get("MainPID", 0)),
                gated=any(
                    _is_our_gate(command[1]) for command in service.get("ExecCondition") or []
                ),
            )
        except (TypeError, ValueError, IndexError, KeyError) as exc:  # not systemd's own types
            raise SystemdError(
                f"{unit}: unexpected property types: {exc}", reason="dbus_error", retryable=False
            ) from exc

    async def unit_names(self, unit: str) -> tuple[str, tuple[str, ...]]:
        """The unit's real name (its Id: an alias answers with the unit it links to) and every
        name it goes by; `no_such_unit` when systemd knows no such unit."""
        props = await self._get_all(await self._unit_path(unit), UNIT_IFACE)
        if props.get("LoadState") == "not-found":
            raise SystemdError(f"{unit}: no such unit", reason="no_such_unit", retryable=False)
        real = str(props.get("Id") or unit)
        return real, tuple(dict.fromkeys([real, *map(str, props.get("Names") or ())]))

    async def pending_job(self, unit: str) -> str:
        """The type of the job systemd runs or queued for `unit` ("start", "restart", "stop",
        ...), or "" when there is none."""
        job = await self.unit_property(unit, "Job")
        try:
            job_id, job_path = job  # systemd's (uo)
        except (TypeError, ValueError) as exc:
            raise SystemdError(
                f"{unit}: unexpected Job property: {exc}", reason="dbus_error", retryable=False
            ) from exc
        if not job_id:
            return ""
        try:
            return str(await self._get(str(job_path), JOB_IFACE, "JobType"))
        except SystemdError:
            return ""  # the job finished between the two calls

    async def unit_property(self, unit: str, name: str) -> Any:
        """One property of the unit's org.freedesktop.systemd1.Unit interface."""
        return await self._get(await self._unit_path(unit), UNIT_IFACE, name)

    async def properties(self, unit: str, wanted: Sequence[tuple[str, str]]) -> dict[str, Any]:
        """A few properties of the unit, (interface, name) each, by name: one Get each, asked
        at once (a GetAll of the Service interface carries some 200 to parse)."""
        path = await self._unit_path(unit)
        values = await asyncio.gather(*(self._get(path, iface, name) for iface, name in wanted))
        return {name: value for (_, name), value in zip(wanted, values, strict=True)}

    async def exec_start(self, unit: str) -> list[str]:
        """The argv of the unit's first ExecStart= command (for environment drift checks)."""
        path = await self._unit_path(unit)
        service = await self._get_all(path, SERVICE_IFACE)
        # ExecStart is a(sasbttttuii): (path, argv, ignore_failure, timestamps, pid, code, status).
        commands = service.get("ExecStart") or []
        return [str(arg) for arg in commands[0][1]] if commands else []

    async def unit_uid(self, unit: str) -> int | None:
        """The uid systemd runs `unit` as (its User=, resolved; a dynamic user's too), or None
        when it set none (root's units, scopes). D-Bus carries the host's uid: the caller's
        user namespace does not hide it."""
        interface = _UID_IFACES.get(unit.rpartition(".")[2])
        if interface is None:
            return None
        path = await self._unit_path(unit)
        body = await self._call(path, PROPS_IFACE, "Get", "ss", [interface, "UID"])
        uid = int(_unwrap({"UID": body[0]})["UID"])
        return None if uid == _UID_INVALID else uid

    async def subscribe(self) -> None:
        """Ask systemd to announce unit changes on the bus (Manager.Subscribe: unprivileged)."""
        await self._call(MANAGER_PATH, MANAGER_IFACE, "Subscribe", "", [])

    async def call_bus(self, member: str, signature: str, body: list[Any]) -> list[Any]:
        """A method of the bus daemon itself (e.g. AddMatch)."""
        return await self._call(
            "/org/freedesktop/DBus",
            "org.freedesktop.DBus",
            member,
            signature,
            body,
            destination="org.freedesktop.DBus",
        )

    async def connected(self) -> MessageBus:
        """The open bus connection (connecting first if needed)."""
        return await self._connected()

    async def _unit_path(self, unit: str) -> str:
        # LoadUnit (unlike GetUnit) also answers for a unit that is not loaded right now, e.g.
        # a stopped service that systemd garbage-collected.
        body = await self._call(MANAGER_PATH, MANAGER_IFACE, "LoadUnit", "s", [unit])
        return str(body[0])

    async def _get(self, path: str, interface: str, name: str) -> Any:
        body = await self._call(path, PROPS_IFACE, "Get", "ss", [interface, name])
        value = body[0]
        return value.value if isinstance(value, Variant) else value

    async def _get_all(self, path: str, interface: str) -> dict[str, Any]:
        body = await self._call(path, PROPS_IFACE, "GetAll", "s", [interface])
        return _unwrap(body[0])

    async def _connected(self) -> MessageBus:
        await self.connect()
        assert self._bus is not None  # noqa: S101 - connect() either set it or raised
        return self._bus

    async def _call(
        self,
        path: str,
        interface: str,
        member: str,
        signature: str,
        body: list[Any],
        *,
        destination: str = SYSTEMD_BUS_NAME,
    ) -> list[Any]:
        what = f"{member}({', '.join(map(str, body))})"
        bus = await self._connected()
        msg = Message(
            destination=destination,
            path=path,
            interface=interface,
            member=member,
            signature=signature,
            body=body,
        )
        try:
            async with asyncio.timeout(self._timeout_s):
                reply = await bus.call(msg)
        except (DBusFastError, OSError, EOFError, TimeoutError) as exc:
            raise map_dbus_error(exc, what) from exc
        if reply.message_type is MessageType.ERROR:
            error = DBusError(
                reply.error_name or "org.freedesktop.DBus.Error.Failed",
                str(reply.body[0]) if reply.body else "",
                reply,
            )
            raise map_dbus_error(error, what) from error
        return list(reply.body)


def _is_our_gate(argv: Any) -> bool:
    """`vllm-supervisor gate ... UNIT`, as the drop-in runs it (ExecCondition's argv)."""
    words = [str(word) for word in argv or []]
    return len(words) > 1 and words[0].endswith("vllm-supervisor") and words[1] == "gate"


def _unwrap(props: Mapping[str, Any]) -> dict[str, Any]:
    """Replace the Variants of a GetAll answer by their values."""
    return {k: v.value if isinstance(v, Variant) else v for k, v in props.items()}


def ask_once(question: Callable[[SystemdClient], Awaitable[T]], *, timeout_s: float) -> T:
    """For a one-shot command (not the daemon): connect to the system bus, ask `question` on
    that one connection, close. SystemdError, OSError and TimeoutError reach the caller."""

    async def run() -> T:
        client = SystemdClient(timeout_s=timeout_s)
        try:
            await client.connect()
            return await question(client)
        finally:
            await client.close()

    return asyncio.run(run())
