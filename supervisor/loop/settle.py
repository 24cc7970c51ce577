"""Settling: an ended invocation is decided once its late lines are read, or its window passed.

A later entry of the unit decides it too (supervisor.track); this covers the quiet journal after
a crash, where no later entry comes. On this host's system journal the wait ends early: once
journald has written every line of the dead processes (no stdout stream is left half closed,
supervisor.journal.streams) and the reader has read up to now. A new batch can move a deadline
earlier (the unit's next start began), so every batch wakes the settler.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import structlog

from ..journal.streams import count_streams
from ..model import Ended
from ..pipeline import Drained, Now, Pipeline
from ..seams import JournalSource
from ..util.aio import first_of

log = structlog.get_logger(__name__)

# While journald still reads a dead process's stream, the settler looks again this often.
DRAIN_POLL_S = 0.005

Decided = Callable[[list[Ended]], Awaitable[None]]
"""Where settled invocations go: recorded like a batch's (the daemon's record path)."""


class Settler:
    """Decides ended invocations once their late lines are read or their window has passed."""

    def __init__(
        self, pipeline: Pipeline, reader: JournalSource, *, machine_id: str, early: bool
    ) -> None:
        """`early`: ask journald and the reader instead of waiting out the window (only the
        system journal's own journald can be asked)."""
        self._pipeline = pipeline
        self._reader = reader
        self._machine_id = machine_id
        self._early = early and reader.can_sync
        self._ending = asyncio.Event()  # set when an ended invocation awaits its late lines

    def wake(self) -> None:
        """A batch was handled: a deadline may have come or moved."""
        if self._pipeline.next_deadline() is not None:
            self._ending.set()

    async def run(self, stop: asyncio.Event, decided: Decided) -> None:
        """Hand `decided` each settled set of outcomes, until `stop`."""
        while not stop.is_set():
            deadline = self._pipeline.next_deadline()
            self._ending.clear()
            if deadline is None:
                await first_of(self._ending.wait(), stop.wait())
                continue
            delay = deadline - time.monotonic()
            if delay > 0:
                if self._early and self._pipeline.settling_on(self._machine_id):
                    if await self._decide_drained(delay, decided):
                        continue
                    delay = min(delay, DRAIN_POLL_S)
                await first_of(self._ending.wait(), stop.wait(), at_most_s=delay)
                continue
            await decided(self._pipeline.due(Now(read=time.monotonic())))

    async def _decide_drained(self, within_s: float, decided: Decided) -> bool:
        """Decide this host's ended invocations if journald has written every line of the dead
        processes and the reader has read up to now. False when that is not known yet: the
        caller looks again, or the window decides."""
        asked = time.monotonic()
        try:
            streams = count_streams()
        except OSError as exc:
            return self._no_probe(f"cannot list journald's stdout streams: {exc}")
        if not streams.listening:
            return self._no_probe(
                "journald's stdout socket is not visible (another network namespace?)"
            )
        if streams.dying or not await self._reader.sync(within_s):
            return False
        ended = self._pipeline.due(Now(), Drained(self._machine_id, asked))
        await decided(ended)
        return bool(ended)

    def _no_probe(self, why: str) -> bool:
        """Fall back to the settle window for good, saying why once; False (nothing decided)."""
        self._early = False
        log.warning(
            "settle_probe_unavailable",
            error=why,
            action="ended runs wait settle_s for their late lines",
        )
        return False
