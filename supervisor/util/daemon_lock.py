"""The daemon's lock files: one daemon per state directory, one per host's system journal,
and who holds them now.

The running daemon holds an exclusive flock on `LOCK_NAME` in its state directory, with its
pid written in the file; `status` asks for a shared lock to learn whether one runs. A daemon
that follows the system journal also holds `HOST_LOCK_NAME` in the default runtime directory,
whatever its own directories: a second one there (an operator's, with a state directory of its
own) would halt and tell every crash again.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..errors import StateError
from .files import make_dirs

LOCK_NAME = "daemon.lock"
HOST_LOCK_NAME = "host.lock"


class DaemonLock:
    """One daemon per state directory: a second one refuses to start, in one line.

    Two daemons on one database would both act and both notify (every message twice).
    """

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_NAME
        self._fd: int | None = None
        self._busy = (
            f"{state_dir}: another vllm-supervisor (pid {{holder}}) already uses this state "
            "directory; stop it first, or give this one its own --state-dir"
        )

    def __enter__(self) -> DaemonLock:
        try:
            fd = self._open(0o600)
        except OSError as exc:
            raise StateError(f"{self.path}: cannot open the lock file: {exc.strerror}") from exc
        self._take(fd)
        return self

    def _open(self, mode: int) -> int:
        make_dirs(self.path.parent)
        return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, mode)

    def _take(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise StateError(self._busy.format(holder=holder)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock
            self._fd = None


class HostLock(DaemonLock):
    """One daemon acting on a host's system journal, whatever its state directory: a second
    one refuses to start, in one line. Taken where it can be: a runtime directory this user
    cannot make or open (no service installed, another account's) takes nothing, and says so
    through `not_taken`."""

    def __init__(self, runtime_dir: Path) -> None:
        super().__init__(runtime_dir)
        self.path = runtime_dir / HOST_LOCK_NAME
        self.not_taken: str | None = None  # why it was not taken, when it was not
        self._busy = (
            "another vllm-supervisor (pid {holder}) already follows this host's journal and "
            "acts on its units: a second one would halt and tell every crash again; stop it "
            "first (systemctl stop vllm-supervisor), or follow a journal directory (--directory)"
        )

    def __enter__(self) -> HostLock:
        try:
            fd = self._open(0o640)
        except OSError as exc:
            self.not_taken = f"{self.path}: {exc.strerror}"
            return self
        self._take(fd)
        return self


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
