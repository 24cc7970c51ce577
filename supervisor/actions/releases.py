"""A `release` the daemon did not hear (it was stopped): kept as a mark beside its socket.

`release` tells the running daemon over its socket to forget the unit's crash streak. With the
daemon stopped nobody heard it, and the streak it saved came back at its next start: the next
crash of a released unit was halted at once (the 3rd of an old count) where a running daemon
would have counted afresh. So `release` leaves an empty file `released.UNIT` in the runtime
directory when the daemon does not answer; the daemon forgets each such unit when it starts
and removes the mark. Only the name counts (the file may be root's and unreadable to the
daemon's user, which may still remove it from its own directory).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from .quarantine import record_name, unit_from_name

PREFIX = "released."


def note_release(runtime_dir: Path, unit: str) -> Path | None:
    """Mark `unit` released for a daemon that is not running; None when the mark cannot be
    left (said by the caller: the next crash then counts on the old streak)."""
    path = runtime_dir / f"{PREFIX}{record_name(unit)}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o640)
    except OSError:
        return None
    os.close(fd)
    return path


def take_releases(runtime_dir: Path) -> list[str]:
    """The units released while the daemon was stopped; their marks removed."""
    try:
        names = sorted(entry.name for entry in runtime_dir.iterdir())
    except OSError:
        return []
    units = []
    for name in names:
        if not name.startswith(PREFIX):
            continue
        with contextlib.suppress(OSError):
            (runtime_dir / name).unlink()
            units.append(unit_from_name(name.removeprefix(PREFIX)))
    return units
