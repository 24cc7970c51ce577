"""The daemon's lock file: one daemon per state directory, and who holds it now.

The running daemon holds an exclusive flock on `LOCK_NAME` in its state directory, with its
pid written in the file; `status` asks for a shared lock to learn whether one runs.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..errors import StateError
from .files import make_dirs

LOCK_NAME = "daemon.lock"


class DaemonLock:
    """One daemon per state directory: a second one refuses to start, in one line.

    Two daemons on one database would both act and both notify (every message twice).
    """

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_NAME
        self._fd: int | None = None

    def __enter__(self) -> DaemonLock:
        try:
            make_dirs(self.path.parent)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise StateError(f"{self.path}: cannot open the lock file: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise StateError(
                f"{self.path.parent}: another vllm-supervisor (pid {holder}) already uses this "
                "state directory; stop it first, or give this one its own --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


def lock_holder(path: Path) -> tuple[bool | None, int | None, str | None]:
    """(running, pid, error): a daemon holds the flock on its lock file while it runs."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False, None, f"no daemon has run with this state directory ({path.parent})"
    except OSError as exc:
        return None, None, f"{path}: {exc.strerror}"
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        pid = int(text) if text.isascii() and text.isdigit() else None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True, pid, None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False, None, "the supervisor is not running"
    except OSError as exc:  # e.g. a directory where the lock file should be
        return None, None, f"{path}: {exc.strerror or exc}"
    finally:
        os.close(fd)
