"""A daemon driven by hand: no journal, the test hands it each batch (`Daemon.handle_batch`).

`HandFed` is the daemon's journal source when there is no journal to read: it follows at once
and yields nothing. `running` runs the daemon (its lanes, its commits, its gates) around a test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from vllm_supervisor.daemon import Daemon
from vllm_supervisor.model import JournalEntry


class HandFed:
    """A journal source that yields no batch of its own."""

    cursor: str | None = None
    cursor_rejected = False
    can_sync = False

    def __init__(self) -> None:
        self.following = asyncio.Event()

    async def batches(self, stop: asyncio.Event | None = None) -> AsyncIterator[list[JournalEntry]]:
        self.following.set()
        if stop is not None:
            await stop.wait()
        return
        yield []  # an async generator that ends at `stop`

    def kick(self) -> int | None:
        return None

    async def sync(self, timeout_s: float) -> bool:
        return True

    def follow_units(self, units: tuple[str, ...]) -> None:
        pass

    def describe(self) -> str:
        return "hand-fed"


@contextlib.asynccontextmanager
async def running(daemon: Daemon) -> AsyncIterator[Daemon]:
    """`daemon` running (lanes, commits, settling) until the block ends."""
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        yield daemon
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
