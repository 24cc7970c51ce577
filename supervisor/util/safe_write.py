"""What root may trust, and how root writes files another account cannot redirect.

`vllm-supervisor setup` runs as root: it writes units whose commands root runs, into system
directories. A path is trustworthy for root only when no other account can change it: it and
every directory above it belong to root and are not writable by a group or the world (a
directory another account can write lets it swap the entries below).

`StagedFiles` writes a set of files all or nothing: each to a temp file of an unpredictable
name opened with O_CREAT|O_EXCL|O_NOFOLLOW (a planted symlink is never followed), fsynced;
only when every one is written are they renamed into place.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import secrets
import stat
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from .files import fsync_directory, make_dirs

ROOT = Path("/")
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class Changeable:
    """A part of a path another account could change, and how."""

    path: Path
    why: str  # "is owned by another account", ...
    uid: int
    gid: int
    mode: int

    def __str__(self) -> str:
        owner = f"owner {_user(self.uid)}, group {_group(self.gid)}, mode {self.mode:04o}"
        return f"{self.path} {self.why} ({owner})"


def untrusted(path: Path, *, top: Path = ROOT, owners: Collection[int] = (0,)) -> Changeable | None:
    """What makes `path` untrustworthy for root, or None: the highest of its directories (up
    to `top`, else /), or the path itself, that an account other than `owners` could change.
    The path as given and with its symlinks resolved are both checked; a part that does not
    exist yet is skipped (root creates it)."""
    for candidate in dict.fromkeys([path, Path(os.path.realpath(path))]):
        for component in _down_from(top, candidate):
            problem = _changeable(component, owners)
            if problem is not None:
                return problem
    return None


def _down_from(top: Path, path: Path) -> list[Path]:
    """`path`'s directories from `top` (when it is one of them) or / down, then `path`."""
    above: list[Path] = []
    for parent in path.parents if path != top else ():
        above.append(parent)
        if parent == top:
            break
    return [*reversed(above), path]


def _changeable(path: Path, owners: Collection[int]) -> Changeable | None:
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None  # not there yet: root makes it, or `unwritable` says why it cannot
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid not in owners:
        why = "is owned by another account"
    elif stat.S_ISLNK(info.st_mode):
        return None  # a link's own mode means nothing; only its owner may change it
    elif mode & 0o002:
        why = "is writable by every account"
    elif mode & 0o020 and info.st_gid != 0:
        why = "is writable by its group"
    else:
        return None
    return Changeable(path, why, info.st_uid, info.st_gid, mode)


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


def unwritable(directory: Path) -> str | None:
    """Why files cannot be made in `directory` (or in the directories to create for it), or
    None. Asked of the nearest part that exists: root passes permission bits, not a read-only
    file system or a file where a directory must be."""
    existing = directory
    while not existing.exists() and not existing.is_symlink():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory, and {directory} must be one"
    with contextlib.suppress(OSError):
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            return f"{existing} is on a read-only file system"
    if not os.access(existing, os.W_OK):
        return f"{existing} is not writable"
    return None


class StagedFiles:
    """Files written all or nothing: `add` each (a temp file beside it), then `commit` renames
    them all into place, or `discard` removes every temp file and directory it made."""

    def __init__(self, *, dir_mode: int = 0o755) -> None:
        self._dir_mode = dir_mode
        self._staged: list[tuple[Path, Path]] = []
        self._made: list[Path] = []

    def add(self, path: Path, data: bytes, *, mode: int) -> None:
        """Write `data` with `mode` exactly to a new temp file in `path`'s directory, fsynced.
        OSError when it cannot be written (what was staged so far stays, for `discard`)."""
        self._made += make_dirs(path.parent, self._dir_mode)
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        fd = os.open(temporary, _NEW_FILE, 0o600)
        self._staged.append((temporary, path))
        try:
            os.fchmod(fd, mode)  # O_CREAT applies the umask; fchmod does not
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def commit(self) -> None:
        """Rename every staged file into place (a reader sees the old file or the new one),
        and make the renames durable."""
        for temporary, path in self._staged:
            temporary.replace(path)
        for directory in dict.fromkeys(path.parent for _, path in self._staged):
            fsync_directory(directory)
        self._staged.clear()
        self._made.clear()

    def discard(self) -> None:
        """Remove the temp files, then the directories `add` made (when empty)."""
        for temporary, _ in self._staged:
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()
        for directory in reversed(self._made):
            with contextlib.suppress(OSError):
                directory.rmdir()
        self._staged.clear()
        self._made.clear()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_regular(path: Path) -> str | None:
    """The text of `path` when it is a regular file, not through a symlink; None when there
    is none (OSError for a symlink, a directory or an unreadable file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise IsADirectoryError(f"{path} is not a regular file")
        return handle.read().decode("utf-8", errors="replace")
