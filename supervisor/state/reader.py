"""The state database's read connection: the daemon's reads, beside the writer's connection.

In WAL mode a reader sees the last committed state and never waits for the writer, so the
small indexed reads the loop makes (what is due in the outbox, a unit's last good environment)
do not queue behind a slow commit. The connection refuses writes (`query_only`).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ..errors import StateError

T = TypeVar("T")


class StateReader:
    """One read-only connection, shared by threads one read at a time."""

    def __init__(self, connection: sqlite3.Connection, path: Path) -> None:
        self.path = path
        self._connection = connection
        self._lock = threading.Lock()
        connection.execute("PRAGMA query_only = ON")

    def read(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """What `work` reads with the connection; errors become `StateError`."""
        with self._lock:
            try:
                return work(self._connection)
            except sqlite3.Error as exc:
                raise StateError(f"{self.path}: read failed: {exc}") from exc

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """The rows of one statement."""
        return self.read(lambda db: db.execute(sql, args).fetchall())

    def tables(self) -> set[str]:
        """The tables the schema has."""
        return {n for (n,) in self.query("SELECT name FROM sqlite_master WHERE type = 'table'")}

    def close(self) -> None:
        with self._lock:
            self._connection.close()
