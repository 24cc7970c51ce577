"""The environment log: snapshots per unit and invocation in the state database, good starts
marked. Its table is made by supervisor.migrations; `EnvironmentTable` is its only SQL."""

from __future__ import annotations

import json
import sqlite3
from typing import ClassVar

from ..errors import StateError
from ..store import Store
from ..util.jsontext import loads
from .snapshot import Change, EnvSnapshot, diff


class EnvironmentTable:
    """`environment_log`: the repository of the environment log's rows."""

    TABLES: ClassVar[tuple[str, ...]] = ("environment_log",)

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def add_start(
        self, unit: str, invocation_id: str, snapshot: str, started: float, keep: int
    ) -> None:
        """Keep a start's snapshot (a replayed start keeps the first); prune the unit's rows."""
        self._db.execute(
            "INSERT OR IGNORE INTO environment_log (unit, invocation_id, started, snapshot) "
            "VALUES (?, ?, ?, ?)",
            (unit, invocation_id, started, snapshot),
        )
        self._db.execute(_PRUNE, (unit, unit, keep, unit))

    def mark_good(self, unit: str, invocation_id: str) -> None:
        self._db.execute(
            "UPDATE environment_log SET good = 1 WHERE unit = ? AND invocation_id = ?",
            (unit, invocation_id),
        )

    def last_good(self, unit: str) -> str | None:
        return self._one(
            "SELECT snapshot FROM environment_log WHERE unit = ? AND good = 1 "
            "ORDER BY started DESC, rowid DESC LIMIT 1",
            (unit,),
        )

    def of_invocation(self, unit: str, invocation_id: str) -> str | None:
        return self._one(
            "SELECT snapshot FROM environment_log WHERE unit = ? AND invocation_id = ?",
            (unit, invocation_id),
        )

    def with_baseline(self, unit: str, invocation_id: str) -> tuple[str, str] | None:
        """The snapshots of the last good start before `invocation_id` and of it."""
        row = self._db.execute(
            "SELECT base.snapshot, this.snapshot FROM environment_log AS this "
            "JOIN environment_log AS base ON base.unit = this.unit AND base.good = 1 "
            "AND base.invocation_id != this.invocation_id AND base.started <= this.started "
            "WHERE this.unit = ? AND this.invocation_id = ? "
            "ORDER BY base.started DESC, base.rowid DESC LIMIT 1",
            (unit, invocation_id),
        ).fetchone()
        return None if row is None else (str(row[0]), str(row[1]))

    def _one(self, sql: str, args: tuple[str, ...]) -> str | None:
        row = self._db.execute(sql, args).fetchone()
        return None if row is None else str(row[0])


class EnvironmentLog:
    """Snapshots per unit and invocation, in the state database, with the good starts marked.

    Each unit keeps its newest `keep` snapshots plus its newest good one, so a long restart loop
    cannot grow the database without bound or push out the baseline. The daemon writes with
    `arecord_start` and `amark_good` (in the state writer's thread); a command or a test off the
    loop may wait for `record_start` and `mark_good`.
    """

    def __init__(self, store: Store, *, keep: int = 100) -> None:
        self.store = store
        self.keep = keep
        store.register(EnvironmentTable)

    def record_start(
        self, unit: str, invocation_id: str, snapshot: EnvSnapshot, time: float
    ) -> None:
        """Keep the snapshot taken when `invocation_id` started (at `time`, epoch seconds).

        A second call for the same invocation (a journal replay) keeps the first snapshot.
        """
        text = _dump(snapshot)
        self.store.write_blocking(
            lambda db: EnvironmentTable(db).add_start(unit, invocation_id, text, time, self.keep)
        )

    async def arecord_start(
        self, unit: str, invocation_id: str, snapshot: EnvSnapshot, time: float
    ) -> None:
        """`record_start`, awaited: the loop goes on while it is written."""
        text = _dump(snapshot)
        await self.store.write(
            lambda db: EnvironmentTable(db).add_start(unit, invocation_id, text, time, self.keep)
        )

    def mark_good(self, unit: str, invocation_id: str) -> None:
        """Mark an invocation's start as good: it ran long enough or reached the serving state."""
        self.store.write_blocking(lambda db: EnvironmentTable(db).mark_good(unit, invocation_id))

    async def amark_good(self, unit: str, invocation_id: str) -> None:
        """`mark_good`, awaited."""
        await self.store.write(lambda db: EnvironmentTable(db).mark_good(unit, invocation_id))

    def last_good(self, unit: str) -> EnvSnapshot | None:
        """The snapshot of the unit's most recent good start, if any."""
        return _load(self.store.read(lambda db: EnvironmentTable(db).last_good(unit)))

    def for_invocation(self, unit: str, invocation_id: str) -> EnvSnapshot | None:
        """The snapshot recorded when `invocation_id` started, if any."""
        found = self.store.read(lambda db: EnvironmentTable(db).of_invocation(unit, invocation_id))
        return _load(found)

    def changes_since_last_good(self, unit: str, invocation_id: str) -> list[Change]:
        """What changed between the last good start before `invocation_id` and `invocation_id`.

        Empty when either snapshot is missing (no good start yet, or the start was not recorded):
        drift is reported only against a known-good baseline.
        """
        pair = self.store.read(lambda db: EnvironmentTable(db).with_baseline(unit, invocation_id))
        if pair is None:
            return []
        base, this = (_snapshot(text) for text in pair)
        return diff(base, this)


def _dump(snapshot: EnvSnapshot) -> str:
    return json.dumps(snapshot.to_json(), sort_keys=True, separators=(",", ":"))


def _load(text: str | None) -> EnvSnapshot | None:
    return None if text is None else _snapshot(text)


def _snapshot(text: str) -> EnvSnapshot:
    """A row read back; StateError when it holds no snapshot (the database is a file anyone
    with root can edit), which every reader already takes as "no drift known"."""
    try:
        return EnvSnapshot.from_json(loads(text))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise StateError(f"environment_log: a row is not a snapshot ({exc!r})") from exc


# Keep a unit's newest `keep` rows and its newest good row; delete the rest.
_PRUNE = """
DELETE FROM environment_log WHERE unit = ?
AND rowid NOT IN (
    SELECT rowid FROM environment_log WHERE unit = ? ORDER BY started DESC, rowid DESC LIMIT ?)
AND rowid NOT IN (
    SELECT rowid FROM environment_log WHERE unit = ? AND good = 1
    ORDER BY started DESC, rowid DESC LIMIT 1)
"""
