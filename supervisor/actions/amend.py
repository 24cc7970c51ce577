"""Adding to a quarantine record already in force, without bringing back one released meanwhile.

A halt writes its record first (the gate refuses from that moment) and stops the unit; what
takes longer to gather (the environment fingerprint: D-Bus round trips, a venv listed) is added
after, so exit → quarantine does not wait for it. By then the gate may have lifted the halt or a
person released it: a plain rename over the record would quarantine the unit again. So the
amended record is swapped in with `renameat2(RENAME_EXCHANGE)`, which fails when the record is
gone, and swapped back if the record it replaced was not the one amended. The record keeps its
mtime: it was in force since then. Where the exchange is not available (an old libc, a
filesystem without it) the record stays as first written.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from pathlib import Path
from typing import Any

from ..util.files import fsync_directory
from ..util.jsontext import loads
from .quarantine import Quarantine

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_LIBC = ctypes.CDLL(None, use_errno=True)
_RENAMEAT2 = getattr(_LIBC, "renameat2", None)


def exchange(first: Path, second: Path) -> None:
    """Swap two paths atomically; both must exist. Raises OSError (ENOENT when one is gone,
    EINVAL or ENOSYS where the filesystem or the libc cannot)."""
    if _RENAMEAT2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not in this libc", str(second))
    done = _RENAMEAT2(
        _AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE
    )
    if done != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(second))


def amend(
    quarantine: Quarantine, unit: str, invocation_id: str | None, extra: dict[str, Any]
) -> bool:
    """Add `extra` to the record of `unit` if it is still the one `invocation_id` wrote; False
    when it is gone, another, or could not be swapped. Raises OSError on a failed write."""
    target = quarantine.path(unit)
    before = _read_bytes(target)
    if before is None:
        return False
    try:
        record = loads(before)
    except ValueError:
        return False
    if not isinstance(record, dict) or record.get("invocation_id") != invocation_id:
        return False
    tmp = quarantine.staged({**record, **extra})
    try:
        with contextlib.suppress(OSError):
            kept = target.stat()
            os.utime(tmp, ns=(kept.st_atime_ns, kept.st_mtime_ns))
        return _swap_in(tmp, target, before)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        fsync_directory(quarantine.directory)


def _swap_in(tmp: Path, target: Path, before: bytes) -> bool:
    try:
        exchange(tmp, target)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.EPERM):
            return False  # released meanwhile, or no exchange here: the record stays as it is
        raise
    if _read_bytes(tmp) == before:
        return True
    with contextlib.suppress(OSError):  # released since: nothing to put back
        exchange(tmp, target)  # a newer record came in between: it stays, ours goes
    return False


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
