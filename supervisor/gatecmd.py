"""`vllm-supervisor gate UNIT` and `release UNIT`: the ExecCondition check and its undo.

`gate` runs as the served unit's `ExecCondition=` (DESIGN.md §3): exit 1 skips the start (and,
since systemd PR #22259, a skipped start is not restarted even with `Restart=always`), exit 0
lets it run. It runs from *another* unit, so it must not trust that unit's RUNTIME_DIRECTORY:
it checks the configured directories and the defaults, runtime and persistent, and fails closed
when a record exists but cannot be read or a directory cannot be searched.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

from supervisor.config import DEFAULT_RUNTIME_DIR, DEFAULT_STATE_DIR
from supervisor.quarantine import Quarantine

QUARANTINE_SUBDIR = "quarantine"
EXIT_ALLOW = 0
EXIT_QUARANTINED = 1  # 1..254 from ExecCondition= skips the start (systemd.service(5))


DEFAULT_DIRS = (DEFAULT_RUNTIME_DIR, DEFAULT_STATE_DIR)


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


def gate_main(
    unit: str,
    runtime_dir: Path,
    state_dir: Path,
    *,
    out: TextIO | None = None,
    defaults: Sequence[Path] = DEFAULT_DIRS,
) -> int:
    """Exit status for ExecCondition: 1 while `unit` is quarantined (or unknowable), else 0."""
    stream = out if out is not None else sys.stderr
    for directory in quarantine_dirs(runtime_dir, state_dir, defaults):
        try:
            record = Quarantine(directory).read(unit)
        except OSError as exc:
            print(
                f"{unit}: start refused, cannot read quarantine in {directory} ({exc.strerror}); "
                "fix the permissions or run the gate as root (ExecCondition=+...)",
                file=stream,
            )
            return EXIT_QUARANTINED
        if record is not None:
            print(f"{unit}: start refused, quarantined: {_summary(record)}", file=stream)
            print(f"release it with: vllm-supervisor release {unit}", file=stream)
            return EXIT_QUARANTINED
    return EXIT_ALLOW


def release_main(
    unit: str,
    runtime_dir: Path,
    state_dir: Path,
    *,
    out: TextIO | None = None,
    defaults: Sequence[Path] = DEFAULT_DIRS,
) -> int:
    """Remove every quarantine record of `unit`; 0 when it is free afterwards."""
    stream = out if out is not None else sys.stdout
    released = 0
    for directory in quarantine_dirs(runtime_dir, state_dir, defaults):
        try:
            record = Quarantine(directory).release(unit)
        except OSError as exc:
            print(f"{unit}: cannot release {directory}: {exc.strerror}", file=sys.stderr)
            return 1
        if record is not None:
            released += 1
            print(f"released {unit} ({directory}): {_summary(record)}", file=stream)
    if released:
        print(f"start it again with: systemctl start {unit}", file=stream)
    else:
        print(f"{unit} is not quarantined", file=stream)
    return 0


def _summary(record: dict[str, Any]) -> str:
    if record.get("corrupt"):
        return f"record is unreadable ({record.get('error')}); treated as quarantined"
    fields: Iterable[str] = (
        f"{key}={record[key]}"
        for key in ("time", "signature", "title", "root_cause", "reason", "invocation_id")
        if record.get(key)
    )
    return "; ".join(fields) or "no details recorded"
