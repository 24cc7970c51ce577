"""The seams of the daemon: what its parts hand each other, in one place.

`app.run_daemon` composes the daemon from parts built beforehand (structlog's
`configure(processors=[...])` is the model): the journal source, hooks that see every batch
and give evidence for every ended invocation before it is decided (drift, the port holder,
the hang watcher), tasks that run beside it (the drift recorder, the watchdog), sources that
find ended invocations the journal never reports
(a hung engine), the actor, the notifier. No part reaches into the daemon: a source is handed
`Supervision`, the narrow face of the daemon it needs, when it runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Protocol

from .config import Config
from .model import Ended, Evidence, JournalEntry, Outcome, UnitState
from .store import Writer

# Runs beside the daemon until its event is set (the drift recorder, the watchdog).
Task = Callable[[asyncio.Event], Coroutine[None, None, None]]


class JournalSource(Protocol):
    """Where the daemon's entries come from (supervisor.journal.reader.JournalctlReader); a test
    hands in batches of its own."""

    cursor: str | None  # the last entry read (of any unit): where the checkpoint stands
    cursor_rejected: bool  # the saved cursor could not be found: nothing to replay up to
    following: asyncio.Event  # set once it follows the journal live

    @property
    def can_sync(self) -> bool:
        """True when `sync` can tell that every entry written so far is read."""
        ...

    def batches(self, stop: asyncio.Event | None = None) -> AsyncIterator[list[JournalEntry]]:
        """Entries in journal order, in batches, until `stop`."""
        ...

    def kick(self) -> int | None:
        """Look at the journal now."""
        ...

    async def sync(self, timeout_s: float) -> bool:
        """True once every entry written before the call is handed out."""
        ...

    def follow_units(self, units: tuple[str, ...]) -> None:
        """Follow these units from now on (a reload)."""
        ...

    def describe(self) -> str:
        """Which reader runs, for the log."""
        ...


class BatchHook(Protocol):
    """Sees each batch before the pipeline, and provides evidence for each ended invocation
    before it is decided.

    `entries` is synchronous and pure (it may drop entries and note what it saw); `evidence`
    may await briefly (in the unit's lane, off the batch) to add what it knows to the one
    evidence record the decision reads (the port's holder: supervisor.decide.port_evidence;
    the drift: supervisor.environment.drift); `reconfigure` takes a reloaded config.
    """

    def entries(self, batch: list[JournalEntry]) -> list[JournalEntry]: ...

    async def evidence(self, ended: Ended, evidence: Evidence) -> Evidence: ...

    def reconfigure(self, config: Config) -> None: ...


class Supervision(Protocol):
    """What the daemon offers a source of ended invocations (supervisor.decide.hang)."""

    def is_open(self, unit: str, invocation_id: str | None) -> bool:
        """True while `unit`'s invocation (`invocation_id`, or any when None) has not ended."""
        ...

    async def end_hung(
        self, unit: str, host: str | None, invocation_id: str | None
    ) -> Outcome | None:
        """End the invocation as hung, then decide, act on and record it like any other;
        the outcome as recorded, or None when it had already ended."""
        ...


class OutcomeSource(Protocol):
    """Finds ended invocations that no journal entry reports, and hands them to the daemon."""

    async def run(self, stop: asyncio.Event, supervision: Supervision) -> None: ...


class Notifying(Protocol):
    """Queues and delivers notifications to every sink (supervisor.notify.fanout.Notifications)."""

    def writer_for(self, outcome: Outcome) -> Writer: ...

    async def run(self, stop: asyncio.Event) -> None: ...

    def wake(self) -> None: ...

    def hold(self, outcome: Outcome) -> None: ...


class StatusReporter(Protocol):
    """Tells systemd how the daemon is (sd_notify)."""

    def ready(self) -> None: ...

    def status(self, text: str) -> None: ...


class UnitStateSource(Protocol):
    """Reads a unit's state (supervisor.actions.systemd.SystemdClient)."""

    async def unit_state(self, unit: str) -> UnitState: ...


class UnitStates(UnitStateSource, Protocol):
    """Reads a unit's state and command line (supervisor.actions.systemd.SystemdClient)."""

    async def exec_start(self, unit: str) -> list[str]: ...
