"""Files and directories only the supervisor's user (and group) can reach; the data files.

The state database holds crash lines and the outbox (which may quote secrets a crashing server
printed); quarantine records decide whether a unit may start. Neither may be world-writable,
whatever umask the daemon inherits (a shell with umask 000, a unit without `UMask=`).
"""

from __future__ import annotations

import os
import stat
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

DIR_MODE = 0o750
FILE_MODE = 0o600


def make_dirs(path: Path, mode: int = DIR_MODE) -> list[Path]:
    """`mkdir -p` where every directory created gets `mode` exactly (not `mode & ~umask` for
    the last one and 0o777 & ~umask for its parents, as `Path.mkdir(parents=True)` does).
    Returns the directories it created, outermost first."""
    missing: list[Path] = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    made: list[Path] = []
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=mode)
        except FileExistsError:
            continue  # created by someone else meanwhile; it is not ours to chmod
        directory.chmod(mode)
        made.append(directory)
    return made


def fsync_directory(directory: Path) -> None:
    """Make a rename or unlink in `directory` durable: the entry is synced with the directory."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def private_file(path: Path, mode: int = FILE_MODE) -> None:
    """Create `path` empty with `mode` when missing; strip world access when it exists.

    Only the world bits are taken from an existing file: a group an administrator granted
    (e.g. to read history) is theirs to keep.
    """
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, mode)
    except FileExistsError:
        current = stat.S_IMODE(path.stat().st_mode)
        if current & 0o007:
            path.chmod(current & ~0o007)
        return
    os.fchmod(fd, mode)  # O_CREAT applies the umask; fchmod does not
    os.close(fd)


def data_path(name: str) -> Path:
    """The installed package's `data/NAME`, else the repository's `config/NAME` (a checkout
    run without installing: the package's data links point there)."""
    package = Path(__file__).resolve().parent.parent
    packaged = package / "data" / name
    return packaged if packaged.exists() else package.parent / "config" / name


def read_toml(path: Path, fail: Callable[[str], Exception]) -> dict[str, Any]:
    """A data file's TOML document; `fail(message)` raised, in one line naming the file, when
    it cannot be read or parsed (nested too deeply included)."""
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise fail(f"{path}: cannot read: {exc}") from exc
    except (tomllib.TOMLDecodeError, RecursionError) as exc:
        raise fail(f"{path}: invalid TOML: {exc}") from exc
