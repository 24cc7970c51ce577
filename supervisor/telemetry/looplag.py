"""Event-loop lag, sampled only while the daemon works: how late a timer set 100 ms ahead ran.

A blocking call on the loop (an fsync, a parse, a /proc scan) delays every timer and socket of
the daemon at once: the watchdog, the gates waiting for a decision, another unit's halt. The lag
of a timer is that delay, as uvloop's and aiomonitor's loop monitors measure it. A probe that
ticked forever would wake an idle daemon 10 times a second, so sampling runs for a second after
each `poke` (a handled batch) and stops: idle, the loop sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

INTERVAL_S = 0.1
BUSY_FOR_S = 1.0


class LoopLag:
    """Samples the running loop's lag while poked; `observe(seconds)` gets each sample."""

    def __init__(self, observe: Callable[[float], None]) -> None:
        self._observe = observe
        self._busy_until = 0.0
        self._handle: asyncio.TimerHandle | None = None

    def poke(self) -> None:
        """Something happened: sample for the next BUSY_FOR_S."""
        loop = asyncio.get_running_loop()
        self._busy_until = loop.time() + BUSY_FOR_S
        if self._handle is None:
            self._schedule(loop)

    @property
    def sampling(self) -> bool:
        """Is a sample pending (the daemon was busy within BUSY_FOR_S)?"""
        return self._handle is not None

    def stop(self) -> None:
        """Cancel the pending sample (shutdown)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        due = loop.time() + INTERVAL_S
        self._handle = loop.call_at(due, self._tick, loop, due)

    def _tick(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        now = loop.time()
        self._observe(now - due)
        if now < self._busy_until:
            self._schedule(loop)
        else:
            self._handle = None
