"""One lane per unit: each unit's actions in the order they were decided, no unit waiting for
another's.

A halt's StopUnit may take its whole timeout, retried (`systemd.stop_attempts` x
`stop_timeout_s`), and a drift snapshot up to 10 s: carried out in the batch that decided them,
they held every other unit, the settle loop and every gate. Here each unit with work has a lane,
a task in the lanes' own TaskGroup (every task has a parent; trio's nursery rule), that runs
the unit's items one batch after another and ends when the unit has nothing left. A unit's items
stay in order (its first crash halts, the later ones join that halt's record); `idle(unit)` waits
until what was handed in for the unit so far is done, which is what a gate's answer waits for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import structlog

log = structlog.get_logger(__name__)

T = TypeVar("T")
# Carries out one unit's items, handed in together; expected failures are its own to handle.
Handler = Callable[[str, list[T]], Awaitable[None]]


class _Lane(Generic[T]):
    def __init__(self) -> None:
        self.items: list[T] = []
        self.busy = 0  # items handed in and not yet done
        self.idle = asyncio.Event()
        self.idle.set()
        self.task: asyncio.Task[None] | None = None


class Lanes(Generic[T]):
    """Runs each unit's items in order, units side by side, inside `run`'s task group."""

    def __init__(self) -> None:
        self._handler: Handler[T] | None = None
        self._lanes: dict[str, _Lane[T]] = {}
        self._group: asyncio.TaskGroup | None = None

    def submit(self, unit: str, item: T) -> None:
        """Hand `item` to `unit`'s lane (started now if the unit has none running)."""
        lane = self._lanes.setdefault(unit, _Lane())
        lane.items.append(item)
        lane.busy += 1
        lane.idle.clear()
        self._start(unit, lane)

    async def idle(self, unit: str) -> None:
        """Return once every item handed in for `unit` so far is done."""
        lane = self._lanes.get(unit)
        if lane is not None:
            await lane.idle.wait()

    def pending(self, unit: str | None = None) -> int:
        """Items handed in and not yet done: `unit`'s, or all units' (None)."""
        if unit is not None:
            lane = self._lanes.get(unit)
            return 0 if lane is None else lane.busy
        return sum(lane.busy for lane in self._lanes.values())

    async def run(self, stop: asyncio.Event, handler: Handler[T]) -> None:
        """Carry out each unit's items with `handler`: own the lanes' tasks until `stop`, then
        until the lanes are done (the daemon's bounded shutdown cancels what a stalled systemd
        keeps running)."""
        self._handler = handler
        async with asyncio.TaskGroup() as group:
            self._group = group
            for unit, lane in self._lanes.items():  # handed in before the group existed
                self._start(unit, lane)
            await stop.wait()
        self._group = None

    def _start(self, unit: str, lane: _Lane[T]) -> None:
        if self._group is None or self._handler is None:
            return
        if lane.task is None or lane.task.done():
            lane.task = self._group.create_task(
                self._drain(unit, lane, self._handler), name=f"lane {unit}"
            )

    async def _drain(self, unit: str, lane: _Lane[T], handler: Handler[T]) -> None:
        while lane.items:
            items, lane.items = lane.items, []
            try:
                await handler(unit, items)
            except Exception as exc:  # a bug in a handler: logged, the lane and daemon go on
                log.error("lane_failed", unit=unit, error=f"{type(exc).__name__}: {exc}")
            lane.busy -= len(items)
        lane.idle.set()
