"""Small asyncio helpers shared by the daemon's long-running tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any


async def first_of(*waits: Awaitable[object], at_most_s: float | None = None) -> None:
    """Wait until the first of `waits` finishes (or `at_most_s` passes); cancel and reap the rest.

    Every task of the daemon waits this way on "its event or stop", so a stop never leaves a
    pending waiter behind.
    """
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, timeout=at_most_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class Nursery:
    """A parent for tasks that synchronous code starts (a D-Bus signal's callback, a halt that
    leaves a gate to watch): every task lives in the TaskGroup that `run` holds (trio's nursery
    rule), none is fire-and-forget. Work started before `run` waits for it; at `stop` what
    still runs is cancelled: such work only watches, and a restart looks again."""

    def __init__(self) -> None:
        self._group: asyncio.TaskGroup | None = None
        self._waiting: list[tuple[Callable[[], Coroutine[Any, Any, None]], str]] = []
        self._running: set[asyncio.Task[None]] = set()

    def start(self, work: Callable[[], Coroutine[Any, Any, None]], name: str) -> None:
        """Run `work()` in the group (once `run` holds it)."""
        if self._group is None:
            self._waiting.append((work, name))
            return
        task = self._group.create_task(work(), name=name)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def run(self, stop: asyncio.Event) -> None:
        """Hold the group until `stop`; then cancel what still runs."""
        async with asyncio.TaskGroup() as group:
            self._group = group
            waiting, self._waiting = self._waiting, []
            for work, name in waiting:
                self.start(work, name)
            await stop.wait()
            self._group = None
            for task in list(self._running):
                task.cancel("stopping")


def name_of(part: object) -> str:
    """A part's name for its task and its log lines: the class of a bound method's owner (or
    of an object), else the function's own name."""
    owner = getattr(part, "__self__", part)
    if owner is not part or not callable(part):
        return type(owner).__name__
    return getattr(part, "__qualname__", type(part).__name__)
