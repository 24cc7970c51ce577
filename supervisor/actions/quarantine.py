"""Quarantine records: one file per halted unit, the race-free half of halting a restart loop.

`gate` (the served unit's `ExecCondition=`) refuses a start while a record exists, so a restart
that races the supervisor's StopUnit is skipped by systemd itself (docs/DESIGN.md §3). Records are
written atomically (temp file, fsync, rename, directory fsync) so `gate` never sees a torn file;
a record that does not parse still counts as quarantined (fail closed).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

import aiofiles.os
import structlog

from ..config import DEFAULT_RUNTIME_DIR, DEFAULT_STATE_DIR, Config
from ..util.files import fsync_directory, make_dirs
from ..util.jsontext import loads

_log = structlog.get_logger(__name__)

FILE_MODE = 0o640
DIR_MODE = 0o750
SUFFIX = ".json"
QUARANTINE_SUBDIR = "quarantine"
DEFAULT_DIRS = (DEFAULT_RUNTIME_DIR, DEFAULT_STATE_DIR)
# Characters systemd allows in unit names, minus "\" and "/"; the rest is %-escaped.
_SAFE = "@:_-."


def record_name(unit: str) -> str:
    """A file name for `unit` that is reversible and safe for any unit name."""
    # surrogateescape: a unit named on the command line may hold bytes that are not UTF-8.
    name = quote(unit, safe=_SAFE, errors="surrogateescape")
    if name.startswith("."):
        # Never ".", ".." or a hidden name (temp files are hidden).
        name = "%2E" + name[1:]
    return name + SUFFIX


def unit_from_name(name: str) -> str:
    """The unit a record file name stands for (inverse of `record_name`)."""
    return unquote(name.removesuffix(SUFFIX), errors="surrogateescape")


class Quarantine:
    """The records in one directory (runtime or persistent)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, unit: str) -> Path:
        """Where the record of `unit` lives."""
        return self.directory / record_name(unit)

    def write(self, unit: str, record: dict[str, Any]) -> Path:
        """Quarantine `unit` with `record` (atomically replacing an older record)."""
        self._ensure_directory()
        target = self.path(unit)
        tmp = self.staged({**record, "unit": unit})
        try:
            tmp.replace(target)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        fsync_directory(self.directory)
        return target

    def staged(self, record: dict[str, Any]) -> Path:
        """`record` written and synced to a new temporary file beside the records (the
        caller renames it into place, or removes it)."""
        fd, name = tempfile.mkstemp(prefix=".tmp-", dir=self.directory)
        try:
            os.fchmod(fd, FILE_MODE)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(record, indent=2, sort_keys=True) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                Path(name).unlink()
            raise
        return Path(name)

    async def write_async(self, unit: str, record: dict[str, Any]) -> Path:
        """`write` from the event loop: its fsyncs run in aiofiles' worker thread, so a slow
        disk delays this halt only, not the watchdog, the gates or another unit's halt."""
        return await aiofiles.os.wrap(self.write)(unit, record)

    def read(self, unit: str) -> dict[str, Any] | None:
        """The record of `unit`; None when it is not quarantined.

        A record that cannot be parsed is returned as `{"unit", "corrupt": True, "error"}` so
        callers still treat the unit as quarantined. Other OSErrors (e.g. EACCES) propagate.
        """
        try:
            # Undecodable bytes make invalid JSON, so a torn or foreign file is a corrupt
            # record (quarantined), never an exception for the gate.
            text = self.path(unit).read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return None
        return _parse(unit, self.path(unit), text)

    def release(self, unit: str) -> dict[str, Any] | None:
        """Remove the record of `unit`; the removed record, or None when there was none."""
        record = self.read(unit)
        if record is None:
            return None
        with contextlib.suppress(FileNotFoundError):
            self.path(unit).unlink()
        fsync_directory(self.directory)
        return record

    def is_quarantined(self, unit: str) -> bool:
        """True while a record (readable or not) exists for `unit`."""
        # Path.exists() raises on EACCES, so an unreadable directory is not taken as "free".
        return self.path(unit).exists()

    def list(self) -> dict[str, dict[str, Any]]:
        """Every quarantined unit and its record."""
        try:
            names = sorted(entry.name for entry in self.directory.iterdir())
        except FileNotFoundError:
            return {}
        records: dict[str, dict[str, Any]] = {}
        for name in names:
            if name.startswith(".") or not name.endswith(SUFFIX):
                continue
            unit = unit_from_name(name)
            record = self.read(unit)
            if record is not None:
                records[unit] = record
        return records

    def _ensure_directory(self) -> None:
        make_dirs(self.directory, DIR_MODE)  # parents too: never world-writable
        self.directory.chmod(DIR_MODE)


def _parse(unit: str, path: Path, text: str) -> dict[str, Any]:
    try:
        record = loads(text)
    except ValueError as exc:
        error = f"not valid JSON: {exc}"
    else:
        if isinstance(record, dict):
            return record
        error = f"expected a JSON object, got {type(record).__name__}"
    _log.warning("quarantine_record_corrupt", unit=unit, path=str(path), error=error)
    return {"unit": unit, "corrupt": True, "error": f"{path}: {error}"}


def quarantine_dir(config: Config) -> Path:
    """Where halts are recorded: runtime (cleared at boot) unless persistence is asked for."""
    base = (
        config.state.state_dir if config.state.persistent_quarantine else config.state.runtime_dir
    )
    return base / QUARANTINE_SUBDIR


def quarantine_dirs(
    runtime_dir: Path, state_dir: Path, defaults: Sequence[Path] = DEFAULT_DIRS
) -> list[Path]:
    """Every directory a record of the daemon may live in, whatever its settings."""
    candidates = (runtime_dir, state_dir, *defaults)
    unique: list[Path] = []
    for base in candidates:
        path = base / QUARANTINE_SUBDIR
        if path not in unique:
            unique.append(path)
    return unique


def quarantine_records(config: Config) -> dict[str, dict[str, Any]]:
    """Every unit's quarantine record, runtime directory first, each with the file it is in."""
    found: dict[str, dict[str, Any]] = {}
    for directory in quarantine_dirs(config.state.runtime_dir, config.state.state_dir, ()):
        records = Quarantine(directory)
        for unit, record in records.list().items():
            found.setdefault(unit, {**record, "path": str(records.path(unit))})
    return found


def quarantined_units(config: Config) -> set[str]:
    """Every unit with a quarantine record, in the runtime or the persistent directory."""
    return set(quarantine_records(config))
