"""What a served unit runs with, as a fingerprint cheap enough to take again before each start.

A fatal crash is usually fixed by changing the unit's environment (`pip install
flashinfer-cubin==0.6.4`) or its config (ExecStart=, Environment=, an EnvironmentFile=, a
drop-in). The quarantine record keeps this fingerprint, taken at halt time; the gate takes it
again before a start and lifts the halt once something in it differs. Nothing is run or
imported: the distributions are the names of the `*.dist-info` directories of the interpreter's
site-packages, files are hashed, the interpreter is stat'ed (bench/gate_recheck.py times it).

A part that cannot be read is left out: out of the fingerprint at halt time, out of the
comparison at the gate, so a fingerprint never says something changed that did not. Unit files
count only while systemd has loaded what is on disk (no `daemon-reload` pending): an edit
systemd does not run yet changes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..util.text import visible
from .probe import NVIDIA_VERSION_PATH, normalize_name, read_nvidia_driver
from .reach import hidden_by
from .snapshot import Change

MAX_FILE_BYTES = 1 << 20  # unit and environment files are small; a larger one is not read
UNREAD = "unread"  # a file whose content could not be read at halt time: only its name counts
MAX_NAMED = 5  # changes named in the gate's line; the rest are counted
_PACKAGE_DIRS = ("site-packages", "dist-packages")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_PYVENV_VERSION = re.compile(r"^\s*version(?:_info)?\s*=\s*(\d+)\.(\d+)", re.MULTILINE)
_PYTHON_VERSION = re.compile(r"^python(\d+)\.(\d+)")


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitSettings:
    """What systemd has loaded for a unit, as far as the fingerprint uses it (D-Bus)."""

    exec_start: tuple[tuple[str, ...], ...] = ()  # each ExecStart= command: path, then argv
    environment: tuple[str, ...] = ()  # Environment= assignments (may hold secrets: hashed)
    environment_files: tuple[str, ...] = ()  # EnvironmentFile= paths, read at each start
    unit_files: tuple[str, ...] = ()  # FragmentPath, then DropInPaths
    needs_reload: bool = False  # NeedDaemonReload: the unit files on disk are not the loaded ones


def take(
    *,
    interpreter: Path | None,
    settings: UnitSettings | None,
    hidden: Callable[[str], str | None] = hidden_by,
    nvidia_version_path: Path = NVIDIA_VERSION_PATH,
) -> dict[str, Any]:
    """The fingerprint of a unit's environment and config, as JSON; only what could be read.

    `hidden` names the sandbox setting that hides a path from this process (the daemon's
    PrivateTmp=, ProtectHome=): a file missing behind it may exist for the gate, so it is
    not recorded as absent.
    """
    found: dict[str, Any] = {}
    if interpreter is not None:
        packages = _packages_of(interpreter)
        if packages:
            found["packages"] = packages
        identity = _identity(str(interpreter))
        if identity is not None:
            found["interpreter"] = {"path": str(interpreter), "identity": identity}
    driver = read_nvidia_driver(nvidia_version_path)
    if driver is not None:
        found["nvidia_driver"] = driver
    if settings is not None:
        found.update(_settings_part(settings, hidden))
    return found


def changes(
    recorded: object,
    settings: UnitSettings | None,
    *,
    nvidia_version_path: Path = NVIDIA_VERSION_PATH,
    packages: Sequence[str] | None = None,
) -> list[str]:
    """What differs between a recorded fingerprint and now, in words; empty when nothing does
    or nothing can be compared. `settings` is systemd's view now (None: it cannot be asked);
    `packages`, the only distributions whose changes count (the halt's signature named them).
    Never raises: the record is read back from disk and may hold anything."""
    if not isinstance(recorded, dict):
        return []
    only = None if packages is None else {normalize_name(name) for name in packages}
    found = _package_changes(recorded.get("packages"), only)
    found += _interpreter_changes(recorded.get("interpreter"))
    driver = recorded.get("nvidia_driver")
    now = read_nvidia_driver(nvidia_version_path)
    if isinstance(driver, str) and now is not None and now != driver:
        found.append(f"nvidia-driver {visible(driver)} → {now}")
    if settings is not None:
        found += _settings_changes(recorded, settings)
    found += _file_changes(recorded.get("environment_files"), "")
    if settings is not None and not settings.needs_reload:
        found += _file_changes(recorded.get("unit_files"), "unit file ")
    return found


def fleet_digest(found: object) -> str | None:
    """One hash of what the hosts of one rollout share of a fingerprint (`take`): the
    distributions and their versions (wherever the venv lies), the interpreter's build (its
    file name and size, not its inode or mtime), the driver, the ExecStart= and Environment=
    digests, and each EnvironmentFile='s content (`--model ${MODEL}` may come from one). The
    unit files themselves are left out: what they say that matters, systemd's loaded
    ExecStart= and Environment= say. None when it holds neither packages nor an ExecStart=
    (too little to say two hosts run the same thing), or when an EnvironmentFile= could not be
    read (its content may differ). Never raises: a record read back may hold anything."""
    if not isinstance(found, dict):
        return None
    shared: dict[str, Any] = {}
    versions: dict[str, str] = {}
    packages = found.get("packages")
    if isinstance(packages, dict):
        for directory in sorted(k for k in packages if isinstance(k, str)):
            if _is_versions(packages[directory]):
                versions.update(packages[directory])
    if versions:
        shared["packages"] = versions
    if _is_digest(found.get("exec_start")):
        shared["exec_start"] = found["exec_start"]
    if not shared:
        return None
    if _is_digest(found.get("environment")):
        shared["environment"] = found["environment"]
    files = found.get("environment_files")
    if isinstance(files, dict) and files:
        states = {path: state for path, state in files.items() if isinstance(path, str)}
        if any(state is not None and not _is_digest(state) for state in states.values()):
            return None  # unread (or malformed): two hosts' files cannot be compared
        shared["environment_files"] = states
    interpreter = found.get("interpreter")
    identity = interpreter.get("identity") if isinstance(interpreter, dict) else None
    if isinstance(identity, str) and identity.count(":") >= 3:
        real, _, size, _ = identity.rsplit(":", 3)
        shared["interpreter"] = f"{Path(real).name}:{size}"
    if isinstance(found.get("nvidia_driver"), str):
        shared["nvidia_driver"] = found["nvidia_driver"]
    return _digest_of(shared)[:32]


def needs_settings(recorded: object) -> bool:
    """Whether comparing `recorded` needs systemd's view of the unit (a D-Bus round trip)."""
    return isinstance(recorded, dict) and any(
        key in recorded for key in ("exec_start", "environment", "unit_files")
    )


def render(found: Sequence[str]) -> str:
    """The changes for one line: the first few named, the rest counted."""
    named = ", ".join(found[:MAX_NAMED])
    more = len(found) - MAX_NAMED
    return f"{named} and {more} more" if more > 0 else named


def package_dirs(interpreter: Path) -> list[Path]:
    """The site-packages directories of an interpreter, found by the layout of its prefix
    (a venv's, a conda env's, Debian's /usr), not by running it: those that exist now."""
    bin_dir = interpreter.parent  # unresolved: a venv's bin/python links out of the venv
    if bin_dir.name != "bin":
        return []
    root = bin_dir.parent
    version = _python_version(interpreter, root)
    if version is None:
        return []
    candidates = [
        root / lib / version / packages for lib in ("lib", "lib64") for packages in _PACKAGE_DIRS
    ]
    candidates.append(root / "lib" / "python3" / "dist-packages")  # Debian's system python
    if root == Path("/usr"):
        candidates.append(Path("/usr/local/lib") / version / "dist-packages")  # sudo pip
    found: list[Path] = []
    seen: set[str] = set()
    for directory in candidates:
        real = os.path.realpath(directory)
        if real not in seen and os.path.isdir(directory):  # noqa: PTH112
            seen.add(real)
            found.append(directory)
    return found


def installed(directory: str) -> dict[str, str]:
    """The distributions in one site-packages directory, by their metadata directories' names
    (`flashinfer_cubin-0.6.3.dist-info` → `flashinfer-cubin: 0.6.3`). Raises OSError."""
    versions: dict[str, list[str]] = {}
    for entry in os.listdir(directory):  # noqa: PTH208 - names only, no Path per entry
        stem, dot, suffix = entry.rpartition(".")
        if not dot or suffix not in ("dist-info", "egg-info"):
            continue
        name, _, version = stem.partition("-")
        versions.setdefault(normalize_name(name), []).append(version.split("-")[0])
    return {name: ", ".join(sorted(found)) for name, found in sorted(versions.items())}


def file_digest(path: str) -> str:
    """The SHA-256 of a small regular file. A FIFO, a device or a huge file is not read (a
    record names the paths root hashes: none may hang the gate). Raises OSError
    (FileNotFoundError when it is not there) or ValueError (a NUL in the path)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_FILE_BYTES:
            raise OSError(f"{path}: not a regular file of at most {MAX_FILE_BYTES} bytes")
        data = os.read(fd, MAX_FILE_BYTES + 1)
        while len(data) <= MAX_FILE_BYTES and (more := os.read(fd, MAX_FILE_BYTES + 1)):
            data += more
        if len(data) > MAX_FILE_BYTES:
            raise OSError(f"{path}: grew past {MAX_FILE_BYTES} bytes while read")
        return hashlib.sha256(data).hexdigest()
    finally:
        os.close(fd)


def _python_version(interpreter: Path, root: Path) -> str | None:
    """`python3.12` for an interpreter: its venv's pyvenv.cfg, else its resolved file name."""
    try:
        config = (root / "pyvenv.cfg").read_text(encoding="utf-8", errors="replace")
    except OSError:
        config = None
    if config is not None:
        match = _PYVENV_VERSION.search(config)
        return None if match is None else f"python{match.group(1)}.{match.group(2)}"
    match = _PYTHON_VERSION.match(Path(os.path.realpath(interpreter)).name)
    return None if match is None else f"python{match.group(1)}.{match.group(2)}"


def _packages_of(interpreter: Path) -> dict[str, dict[str, str]]:
    packages: dict[str, dict[str, str]] = {}
    for directory in package_dirs(interpreter):
        try:
            packages[str(directory)] = installed(str(directory))
        except OSError:
            continue  # unreadable now: recorded as nothing, never as empty
    return packages


def _identity(path: str) -> str | None:
    """What changes when the interpreter is replaced (an upgrade, a rebuilt venv's python)."""
    try:
        info = os.stat(path)  # noqa: PTH116 - follows the venv's link to the real binary
    except (OSError, ValueError):
        return None
    return f"{os.path.realpath(path)}:{info.st_ino}:{info.st_size}:{info.st_mtime_ns}"


def _digest_of(value: object) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _settings_part(settings: UnitSettings, hidden: Callable[[str], str | None]) -> dict[str, Any]:
    unit_files = (
        dict.fromkeys(settings.unit_files, UNREAD)
        if settings.needs_reload  # on disk is not what runs: their names count, not content
        else _file_states(settings.unit_files, hidden)
    )
    return {
        "exec_start": _digest_of([list(command) for command in settings.exec_start]),
        "environment": _digest_of(list(settings.environment)),
        "environment_files": _file_states(settings.environment_files, hidden),
        "unit_files": unit_files,
    }


def _file_states(paths: Sequence[str], hidden: Callable[[str], str | None]) -> dict[str, Any]:
    """Each file's digest; None for one that is not there, UNREAD for one that cannot be read
    (or that a sandbox may hide from this process)."""
    states: dict[str, Any] = {}
    for path in paths:
        try:
            states[path] = file_digest(path)
        except FileNotFoundError:
            states[path] = None if hidden(path) is None else UNREAD
        except (OSError, ValueError):
            states[path] = UNREAD
    return states


def _package_changes(recorded: object, only: set[str] | None = None) -> list[str]:
    if not isinstance(recorded, dict):
        return []
    found: list[str] = []
    for directory, before in recorded.items():
        if not _is_package_dir(directory) or not _is_versions(before):
            continue
        try:
            after = installed(directory)
        except (OSError, ValueError):
            continue  # gone or unreadable now: cannot tell, so nothing changed
        names = set(before) | set(after)
        for name in sorted(names if only is None else names & only):
            old, new = before.get(name), after.get(name)
            if old != new:
                found.append(
                    str(
                        Change(
                            name=visible(name),
                            before=None if old is None else visible(old),
                            after=None if new is None else visible(new),
                        )
                    )
                )
    return found


def _is_package_dir(directory: object) -> bool:
    """Only a site-packages directory is listed: a record cannot send root anywhere else."""
    return (
        isinstance(directory, str)
        and directory.startswith("/")
        and Path(directory).name in _PACKAGE_DIRS
    )


def _is_versions(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _interpreter_changes(recorded: object) -> list[str]:
    if not isinstance(recorded, dict):
        return []
    path, identity = recorded.get("path"), recorded.get("identity")
    if not isinstance(path, str) or not isinstance(identity, str) or not path.startswith("/"):
        return []
    now = _identity(path)
    return [] if now is None or now == identity else [f"the interpreter {visible(path)} changed"]


def _settings_changes(recorded: Mapping[str, Any], settings: UnitSettings) -> list[str]:
    found: list[str] = []
    exec_start = _digest_of([list(command) for command in settings.exec_start])
    if _is_digest(recorded.get("exec_start")) and recorded["exec_start"] != exec_start:
        found.append("ExecStart= changed")
    environment = _digest_of(list(settings.environment))
    if _is_digest(recorded.get("environment")) and recorded["environment"] != environment:
        found.append("Environment= changed")
    found += _list_changes(recorded.get("environment_files"), settings.environment_files, "")
    found += _list_changes(recorded.get("unit_files"), settings.unit_files, "unit file ")
    return found


def _list_changes(recorded: object, now: Sequence[str], what: str) -> list[str]:
    """Files the unit names now and did not at the halt, and the other way round."""
    if not isinstance(recorded, dict):
        return []
    before = {path for path in recorded if isinstance(path, str)}
    added = [f"{what}{visible(path)} added" for path in now if path not in before]
    return added + [f"{what}{visible(path)} dropped" for path in sorted(before - set(now))]


def _file_changes(recorded: object, what: str) -> list[str]:
    if not isinstance(recorded, dict):
        return []
    found: list[str] = []
    for path, before in recorded.items():
        if not isinstance(path, str) or not path.startswith("/"):
            continue
        if before is not None and not _is_digest(before):
            continue  # UNREAD at halt time, or malformed: nothing to compare with
        try:
            after: str | None = file_digest(path)
        except FileNotFoundError:
            after = None
        except (OSError, ValueError):
            continue
        if after == before:
            continue
        state = "created" if before is None else "removed" if after is None else "changed"
        found.append(f"{what}{visible(path)} {state}")
    return found


def _is_digest(value: object) -> bool:
    return isinstance(value, str) and _DIGEST.match(value) is not None
