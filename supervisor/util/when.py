"""Times read from outside (journal entries, state rows, another process's metrics)."""

from __future__ import annotations

from datetime import UTC, datetime


def utc(value: object, *, per_second: int = 1) -> datetime | None:
    """`value` (in units of 1/`per_second` s since the epoch) as an aware UTC datetime; None
    when it is no number or lies beyond what a datetime holds: a clock set to the year 300000
    stamps its journal entries so, and a state row edited by hand may hold anything."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return datetime.fromtimestamp(value / per_second, UTC)
    except (OverflowError, OSError, ValueError):
        return None


def clock_time(when: float) -> str:
    """Unix time `when` as a person reads a deadline today: "10:42:07 UTC" ("unknown" for no
    time a datetime holds)."""
    at = utc(when)
    return "unknown" if at is None else at.strftime("%H:%M:%S UTC")


def iso_seconds(value: object, *, per_second: int = 1) -> str | None:
    """`value` (as for `utc`) in ISO 8601, UTC, to the second; None for no time it holds."""
    at = utc(value, per_second=per_second)
    return None if at is None else at.isoformat(timespec="seconds")
