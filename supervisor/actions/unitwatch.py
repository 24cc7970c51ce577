"""Hear from systemd the moment a supervised unit changes state, to read the journal at once.

journald tells journal readers about new entries through a timer (up to 250 ms on systemd 252),
so a crash would sit unread in the journal files for that long. systemd itself announces the
unit's state change on the bus (PropertiesChanged, once a client called Manager.Subscribe), right
after PID 1 logged "Main process exited": the daemon then asks the reader to look now. Nothing is
decided from the signal itself: it only says "read the journal".

The match covers every unit's object path (`path_namespace`) and the handler keeps the supervised
ones, so a reloaded config needs no new match. Idle, this costs no wake-up: the bus socket waits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from ..util.aio import first_of
from ..util.retry import Backoff
from .systemd import SystemdClient

log = structlog.get_logger(__name__)

UNIT_PATHS = "/org/freedesktop/systemd1/unit"
MATCH = (
    "type='signal',sender='org.freedesktop.systemd1',"
    "interface='org.freedesktop.DBus.Properties',member='PropertiesChanged',"
    f"path_namespace='{UNIT_PATHS}'"
)
RETRY_S = 1.0
RETRY_MAX_S = 60.0


def unit_path(unit: str) -> str:
    """The unit's object path, escaped as systemd's bus_label_escape does (byte by byte)."""
    escaped = "".join(
        chr(byte) if _ALNUM[byte] and (index > 0 or not chr(byte).isdigit()) else f"_{byte:02x}"
        for index, byte in enumerate(unit.encode())
    )
    return f"{UNIT_PATHS}/{escaped}"


_ALNUM = [chr(b).isascii() and chr(b).isalnum() for b in range(256)]


class UnitWatch:
    """Calls `changed(unit)` when systemd announces a state change of a supervised unit."""

    def __init__(
        self,
        systemd: SystemdClient,
        units: Callable[[], list[str]],
        changed: Callable[[str], object],
    ) -> None:
        self._systemd = systemd
        self._units = units
        self._changed = changed

    async def run(self, stop: asyncio.Event) -> None:
        """Subscribe, then wait; subscribe again after the bus went away (capped backoff)."""
        retry = Backoff(RETRY_S, RETRY_MAX_S)
        failures = 0
        while not stop.is_set():
            try:
                bus = await self._subscribe()
            except Exception as exc:  # any bus failure: the reader still follows, only later
                failures += 1
                if failures == 1:
                    log.warning(
                        "unit_watch_unavailable",
                        error=str(exc),
                        action="crashes are read at journald's next notification (<= 250 ms)",
                    )
                await first_of(stop.wait(), at_most_s=retry.delay(failures))
                continue
            if failures:
                log.info("unit_watch_recovered")
            failures = 0
            await first_of(stop.wait(), bus.wait_for_disconnect())  # type: ignore[no-untyped-call]
            with contextlib.suppress(Exception):
                bus.remove_message_handler(self._on_message)

    async def _subscribe(self) -> MessageBus:
        bus = await self._systemd.connected()
        bus.add_message_handler(self._on_message)
        await self._systemd.call_bus("AddMatch", "s", [MATCH])
        await self._systemd.subscribe()
        return bus

    def _on_message(self, message: Message) -> None:
        if message.message_type is not MessageType.SIGNAL or message.member != "PropertiesChanged":
            return
        path = message.path or ""
        if not path.startswith(UNIT_PATHS):
            return
        for unit in self._units():
            if unit_path(unit) == path:
                self._changed(unit)
                return
