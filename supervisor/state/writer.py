"""The one writer of the state database: a thread that owns the write connection.

Every write is a unit of work (`Work`: a function of the connection) that the writer runs as one
transaction in its thread, one at a time, in the order submitted: nothing else writes, so two
writes never interleave, and a slow disk (SQLite's fsync) delays the writes queued behind it,
never the event loop that awaits them (`write`). Callers off the loop (the commands, start-up)
may wait for a write instead (`write_blocking`).

A unit of work names what it changes through the repositories of the tables it touches; each
table has one repository (`register` refuses a second owner, and a table no migration made).
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import ClassVar, Protocol, TypeVar

from ..errors import StateError

T = TypeVar("T")
Work = Callable[[sqlite3.Connection], T]


class Repository(Protocol):
    """The SQL of one or more tables, over a connection handed in."""

    TABLES: ClassVar[tuple[str, ...]]


class StateWriter:
    """Runs units of work as transactions on the one write connection, in its own thread."""

    def __init__(self, connection: sqlite3.Connection, path: Path) -> None:
        self.connection = connection  # used only in the writer's thread once it is handed over
        self.path = path
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-writer")
        self._after: threading.local = threading.local()
        self._owners: dict[str, type] = {}
        self._closed = False

    def register(self, repository: type[Repository], tables: set[str]) -> None:
        """`repository` owns its TABLES; `tables` are those the migrated schema has."""
        for table in repository.TABLES:
            owner = self._owners.setdefault(table, repository)
            if owner is not repository:
                raise StateError(
                    f"{self.path}: table {table} has two owners: {owner.__name__} and "
                    f"{repository.__name__}"
                )
            if table not in tables:
                raise StateError(
                    f"{self.path}: no table {table} for {repository.__name__}: a step is missing "
                    "from supervisor.migrations"
                )

    def submit(self, work: Work[T]) -> Future[T]:
        """Queue `work`; its future holds what it returned once committed (or its error)."""
        if self._closed:
            raise StateError(f"{self.path}: the state database is closed")
        return self._thread.submit(self._transaction, work)

    async def write(self, work: Work[T]) -> T:
        """Run `work` as one transaction in the writer's thread; the loop goes on meanwhile."""
        return await asyncio.wrap_future(self.submit(work))

    def write_blocking(self, work: Work[T]) -> T:
        """`write` for a caller that is not an event loop (a command, start-up, a test)."""
        return self.submit(work).result()

    def after_commit(self, callback: Callable[[], None]) -> None:
        """From inside a unit of work: call `callback` (in the writer's thread) once its
        transaction is committed; never after a rollback."""
        pending: list[Callable[[], None]] | None = getattr(self._after, "callbacks", None)
        if pending is None:
            raise RuntimeError("after_commit outside a unit of work of the state writer")
        pending.append(callback)

    def close(self) -> None:
        """Finish the writes queued, then close the connection."""
        if self._closed:
            return
        self._closed = True
        self._thread.shutdown(wait=True)
        self.connection.close()

    def _transaction(self, work: Work[T]) -> T:
        db = self.connection
        self._after.callbacks = []
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                result = work(db)
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        except sqlite3.Error as exc:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise StateError(f"{self.path}: write failed: {exc}") from exc
        finally:
            callbacks, self._after.callbacks = self._after.callbacks, None
        for callback in callbacks:
            callback()
        return result
