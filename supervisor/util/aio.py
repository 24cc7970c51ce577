"""Small asyncio helpers shared by the daemon's long-running tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable


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
