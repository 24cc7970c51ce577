"""What a sink told while the state database could not record it, kept across daemon restarts.

While the state disk is full the outbox tells from memory (supervisor.notify.outbox): a crash
whose batch could not be committed, a message whose "sent" could not be recorded. A daemon
restarted then read the uncommitted batch again and told its crashes a second time. The
runtime directory is another file system (a tmpfs under /run, kept across the daemon's
restarts by `RuntimeDirectoryPreserve=yes`, cleared at boot): what was told from memory is
written there, and the next daemon records it as told instead of telling it again. The file
is small (bounded) and best effort: a write that fails is said once, and costs at most the
duplicate it would have saved.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path

import structlog

from ..util.jsontext import loads
from .queue import MemberKey

log = structlog.get_logger(__name__)

MAX_ENTRIES = 4096  # the newest kept: a full disk for days of crash loops, not a leak
_SEPARATOR = "\t"  # no unit name holds a tab


def told_path(runtime_dir: Path, sink: str) -> Path:
    return runtime_dir / "told" / f"{sink}.json"


class ToldLedger:
    """The crashes (by member) and messages (by id) one sink told that the database lacks."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._failed = False

    def load(self) -> tuple[dict[MemberKey, float], dict[int, float]]:
        """What an earlier daemon told and could not record; empty when there is no readable
        file (a missing or damaged one only risks a duplicate)."""
        try:
            raw = loads(self.path.read_bytes())
        except (OSError, ValueError):
            return {}, {}
        if not isinstance(raw, dict):
            return {}, {}
        held: dict[MemberKey, float] = {}
        for key, when in _pairs(raw.get("held")):
            unit, separator, dedupe = key.partition(_SEPARATOR)
            if separator:
                held[(unit, dedupe)] = when
        unrecorded = {
            int(key): when
            for key, when in _pairs(raw.get("unrecorded"))
            if key.isascii() and key.isdigit() and len(key) < 19
        }
        return held, unrecorded

    def save(self, held: Mapping[MemberKey, float], unrecorded: Mapping[int, float]) -> None:
        """Replace the file with these (the newest MAX_ENTRIES of each); remove it when both
        are empty. Never raises."""
        try:
            if not held and not unrecorded:
                self.path.unlink(missing_ok=True)
                return
            body = {
                "held": dict(_newest({f"{u}{_SEPARATOR}{k}": t for (u, k), t in held.items()})),
                "unrecorded": dict(_newest({str(i): t for i, t in unrecorded.items()})),
            }
            self.path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
            partial = self.path.with_suffix(".tmp")
            descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
            with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
                json.dump(body, handle)
            partial.replace(self.path)
        except OSError as exc:
            if not self._failed:
                log.warning(
                    "told_ledger_failed",
                    path=str(self.path),
                    error=exc.strerror or repr(exc),
                    action="a restart while the state disk is full may tell these crashes again",
                )
            self._failed = True
            return
        self._failed = False


def _pairs(value: object) -> list[tuple[str, float]]:
    """The (key, time) pairs of a JSON object read back: what is not one is left out."""
    if not isinstance(value, dict):
        return []
    pairs = []
    for key, when in value.items():
        if not isinstance(key, str) or isinstance(when, bool) or not isinstance(when, int | float):
            continue
        try:
            seconds = float(when)
        except OverflowError:
            continue
        if math.isfinite(seconds):
            pairs.append((key, seconds))
    return pairs


def _newest(entries: Mapping[str, float]) -> list[tuple[str, float]]:
    return sorted(entries.items(), key=lambda item: item[1])[-MAX_ENTRIES:]
