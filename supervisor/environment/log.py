"""The environment log: snapshots per unit and invocation in the state database, good starts
marked."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from ..errors import StateError
from ..store import Store, Writer
from .snapshot import Change, EnvSnapshot, diff

_SCHEMA = """
CREATE TABLE IF NOT EXISTS environment_log (
    unit TEXT NOT NULL,
    invocation_id TEXT NOT NULL,
    started REAL NOT NULL,
    snapshot TEXT NOT NULL,
    good INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (unit, invocation_id)
);
CREATE INDEX IF NOT EXISTS environment_log_unit_started ON environment_log (unit, started);
"""


class EnvironmentLog:
    """Snapshots per unit and invocation, in the state database, with the good starts marked.

    Each unit keeps its newest `keep` snapshots plus its newest good one, so a long restart loop
    cannot grow the database without bound or push out the baseline.
    """

    def __init__(self, store: Store, *, keep: int = 100) -> None:
        self.store = store
        self.keep = keep
        try:
            store.connection.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise StateError(f"{store.path}: cannot create the environment log: {exc}") from exc

    def record_start(
        self, unit: str, invocation_id: str, snapshot: EnvSnapshot, time: float
    ) -> None:
        """Keep the snapshot taken when `invocation_id` started (at `time`, epoch seconds).

        A second call for the same invocation (a journal replay) keeps the first snapshot.
        """
        with self.store.transaction() as db:
            self.start_writer(unit, invocation_id, snapshot, time)(db)

    def start_writer(
        self, unit: str, invocation_id: str, snapshot: EnvSnapshot, time: float
    ) -> Writer:
        """`record_start` as a writer for `Store.commit_batch(extra=...)`, to share its commit."""
        text = json.dumps(snapshot.to_json(), sort_keys=True, separators=(",", ":"))

        def write(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT OR IGNORE INTO environment_log (unit, invocation_id, started, snapshot) "
                "VALUES (?, ?, ?, ?)",
                (unit, invocation_id, time, text),
            )
            db.execute(_PRUNE, (unit, unit, self.keep, unit))

        return write

    def mark_good(self, unit: str, invocation_id: str) -> None:
        """Mark an invocation's start as good: it ran long enough or reached the serving state."""
        with self.store.transaction() as db:
            self.good_writer(unit, invocation_id)(db)

    def good_writer(self, unit: str, invocation_id: str) -> Writer:
        """`mark_good` as a writer for `Store.commit_batch(extra=...)`."""

        def write(db: sqlite3.Connection) -> None:
            db.execute(
                "UPDATE environment_log SET good = 1 WHERE unit = ? AND invocation_id = ?",
                (unit, invocation_id),
            )

        return write

    def last_good(self, unit: str) -> EnvSnapshot | None:
        """The snapshot of the unit's most recent good start, if any."""
        rows = self._query(
            "SELECT snapshot FROM environment_log WHERE unit = ? AND good = 1 "
            "ORDER BY started DESC, rowid DESC LIMIT 1",
            (unit,),
        )
        return EnvSnapshot.from_json(json.loads(rows[0][0])) if rows else None

    def for_invocation(self, unit: str, invocation_id: str) -> EnvSnapshot | None:
        """The snapshot recorded when `invocation_id` started, if any."""
        rows = self._query(
            "SELECT snapshot FROM environment_log WHERE unit = ? AND invocation_id = ?",
            (unit, invocation_id),
        )
        return EnvSnapshot.from_json(json.loads(rows[0][0])) if rows else None

    def changes_since_last_good(self, unit: str, invocation_id: str) -> list[Change]:
        """What changed between the last good start before `invocation_id` and `invocation_id`.

        Empty when either snapshot is missing (no good start yet, or the start was not recorded):
        drift is reported only against a known-good baseline.
        """
        rows = self._query(
            "SELECT base.snapshot, this.snapshot FROM environment_log AS this "
            "JOIN environment_log AS base ON base.unit = this.unit AND base.good = 1 "
            "AND base.invocation_id != this.invocation_id AND base.started <= this.started "
            "WHERE this.unit = ? AND this.invocation_id = ? "
            "ORDER BY base.started DESC, base.rowid DESC LIMIT 1",
            (unit, invocation_id),
        )
        if not rows:
            return []
        base, this = (EnvSnapshot.from_json(json.loads(text)) for text in rows[0])
        return diff(base, this)

    def _query(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        return self.store.query(sql, args)


# Keep a unit's newest `keep` rows and its newest good row; delete the rest.
_PRUNE = """
DELETE FROM environment_log WHERE unit = ?
AND rowid NOT IN (
    SELECT rowid FROM environment_log WHERE unit = ? ORDER BY started DESC, rowid DESC LIMIT ?)
AND rowid NOT IN (
    SELECT rowid FROM environment_log WHERE unit = ? AND good = 1
    ORDER BY started DESC, rowid DESC LIMIT 1)
"""
