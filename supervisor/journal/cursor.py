"""What a journal cursor says of its entry: `s=FILE;i=SEQ;b=BOOT;m=MONOTONIC;t=REALTIME;x=XOR`.

The cursor carries the entry's boot and monotonic time as well as its wall-clock time, so
durations within a boot are measured on the clock that does not step (a person's `date -s`,
NTP's first sync at boot), without asking the reader for more fields.
"""

from __future__ import annotations

import string

_HEX = frozenset(string.hexdigits)


def cursor_fields(cursor: str) -> dict[str, str]:
    """The cursor's `key=value` parts (an unreadable cursor gives what it can, maybe none)."""
    fields: dict[str, str] = {}
    for part in cursor.split(";"):
        key, equals, value = part.partition("=")
        if equals:
            fields[key] = value
    return fields


def cursor_monotonic(cursor: str | None) -> tuple[str, int] | None:
    """(boot id, monotonic microseconds) of the cursor's entry, when it says both."""
    if not cursor:
        return None
    fields = cursor_fields(cursor)
    boot, monotonic = fields.get("b"), fields.get("m")
    if not boot or not monotonic or not all(c in _HEX for c in monotonic):
        return None
    return boot, int(monotonic, 16)


def monotonic_seconds_between(first: str | None, last: str | None) -> float | None:
    """Seconds from the entry at cursor `first` to the one at `last`, on the monotonic clock;
    None unless both are readable and of the same boot."""
    start, end = cursor_monotonic(first), cursor_monotonic(last)
    if start is None or end is None or start[0] != end[0]:
        return None
    return max(0.0, (end[1] - start[1]) / 1e6)
