"""Which supervised units systemd has, for the per-unit metrics.

The shipped config names sglang.service and tgi.service beside vllm.service; a host runs one of
them. A unit systemd has no file for (LoadState=not-found) exports one series saying so instead of
the ~160 series of a supervised unit (telemetry.metrics). systemd is asked once for each unit (at
the start; a unit configured by a reload at the next scrape), and again for a unit not known to
exist whenever systemd announces a change of it (UnitWatch: installed and started later). Absent
only on systemd's word: a unit it could not be asked about gets every series, so that the alerts'
increase() sees their first event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import structlog

from ..errors import SystemdError
from ..seams import UnitStates
from ..util.aio import first_of

log = structlog.get_logger(__name__)

NO_SUCH_UNIT = "no_such_unit"  # SystemdClient.unit_state's reason for LoadState=not-found


class InstalledUnits:
    """Asks systemd whether it has each supervised unit and reports the answer."""

    def __init__(
        self,
        systemd: UnitStates | None,
        units: Callable[[], Iterable[str]],
        report: Callable[[str, bool | None], None],
    ) -> None:
        self._systemd = systemd  # None: systemd is not used, nothing can be said
        self._units = units
        self._report = report  # (unit, True: installed | False: no such unit | None: unknown)
        self._asked: set[str] = set()
        self._installed: set[str] = set()
        self._due: set[str] = set()
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Ask about the units configured since the last look (a reload); cheap, no D-Bus."""
        if set(self._units()) - self._asked:
            self._wake.set()

    def changed(self, unit: str) -> None:
        """systemd announced a change of `unit`: ask again unless it is known to exist."""
        if unit not in self._installed:
            self._due.add(unit)
            self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Ask about each unit not asked yet (all at the start), then wait for changes."""
        while not stop.is_set():
            self._wake.clear()
            due = (set(self._units()) - self._asked) | self._due
            self._due = set()
            for unit in sorted(due):
                self._asked.add(unit)
                installed = await self._ask(unit)
                if installed:
                    self._installed.add(unit)
                self._report(unit, installed)
            await first_of(stop.wait(), self._wake.wait())

    async def _ask(self, unit: str) -> bool | None:
        if self._systemd is None:
            return None
        try:
            state = await self._systemd.unit_state(unit)
        except SystemdError as exc:
            if exc.reason == NO_SUCH_UNIT:
                log.info("unit_not_installed", unit=unit, metrics="unit_present 0 only")
                return False
            return None
        except Exception:  # a metric's detail must never end the daemon's task group
            return None
        if not state.gated:
            log.warning(
                "unit_not_gated",
                unit=unit,
                action="its loaded ExecCondition= runs no gate of ours (none installed, or a "
                "drop-in emptied it): a halt stops it but nothing refuses its next start, and no "
                "held start is held; run `vllm-supervisor setup`",
            )
        return True
