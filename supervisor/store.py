"""The state database (SQLite): journal checkpoint, policy state, crash history, outbox.

Its schema is versioned (supervisor.migrations): opening a database upgrades it.

Everything one handled batch changes is committed in **one transaction**: the new cursor, the
invocations it decided (each an action pending) and the policy's per-unit memory. A crash of the
supervisor at any point therefore either keeps all of a batch or none of it, and the batch is
read again from the previous cursor: every entry is handled exactly once. An action is carried
out after its batch; what it did (`taken`) is committed with the invocation's history and the
notifications it queued, in one transaction that also clears the pending action. A supervisor
that dies in between finds the action pending at its next start (`pending_actions`).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .errors import StateError
from .migrations import migrate
from .model import Outcome
from .records import outcome_from_record, outcome_record
from .util.files import make_dirs, private_file

DATABASE_NAME = "state.sqlite3"

Writer = Callable[[sqlite3.Connection], None]
"""Extra work to run inside a batch's transaction (e.g. queueing notifications)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint:
    """Where reading resumes.

    `cursor` is the last entry fully handled. `replay_from` is the first entry of the oldest
    invocation still open at that point: reading restarts there so the open invocation's lines
    are tracked again, but nothing up to `cursor` is acted on a second time.
    """

    cursor: str | None = None
    replay_from: str | None = None


class Store:
    """One SQLite database in the state directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            make_dirs(path.parent)
            # SQLite gives the -wal and -shm files the mode of the database file itself.
            for suffix in ("", "-wal", "-shm"):
                if not suffix or Path(f"{path}{suffix}").exists():
                    private_file(Path(f"{path}{suffix}"))
            # The daemon commits from a worker thread (a slow fsync must not stall the event
            # loop); every use of the connection holds `lock`, so uses never interleave.
            self.connection = sqlite3.connect(
                path, isolation_level=None, timeout=10, check_same_thread=False
            )
            self.lock = threading.RLock()
            self.connection.execute("PRAGMA journal_mode=WAL")
            # FULL: a committed cursor survives power loss, not only a crash of the process.
            self.connection.execute("PRAGMA synchronous=FULL")
            migrate(self.connection, path)
        except sqlite3.Error as exc:
            raise StateError(f"{path}: cannot open the state database: {exc}") from exc
        except OSError as exc:
            raise StateError(f"{path.parent}: cannot create the state directory: {exc}") from exc

    @classmethod
    def in_directory(cls, state_dir: Path) -> Store:
        """Open (or create) the database in `state_dir`."""
        return cls(state_dir / DATABASE_NAME)

    @classmethod
    def existing_in_directory(cls, state_dir: Path) -> Store | None:
        """The daemon's database for a command that only reads it (triage, preflight, the demo).

        None when there is none (opening it would create it; the daemon owns that) or it cannot
        be opened: what such a command reads from it is extra information, never a reason to fail.
        """
        try:
            return cls.read_only(state_dir)
        except StateError:
            return None

    @classmethod
    def read_only(cls, state_dir: Path) -> Store:
        """The daemon's database opened for reading only: nothing is created, fixed or written.

        StateError says why it cannot be read (`no state database at PATH` when there is none).
        """
        path = state_dir / DATABASE_NAME
        try:
            path.stat()
        except FileNotFoundError:
            raise StateError(f"no state database at {path}") from None
        except OSError as exc:
            raise StateError(f"{path}: cannot read the state database: {exc.strerror}") from exc
        store = cls.__new__(cls)
        store.path, store.lock = path, threading.RLock()
        try:
            store.connection = sqlite3.connect(
                _read_only_uri(path), uri=True, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise StateError(f"{path}: cannot read the state database: {exc}") from exc
        try:
            store.connection.execute("SELECT count(*) FROM sqlite_master").fetchone()
        except sqlite3.Error as exc:
            store.connection.close()
            raise StateError(f"{path}: cannot read the state database: {exc}") from exc
        return store

    @classmethod
    def recover_in_directory(
        cls, state_dir: Path, *, now: Callable[[], float] = time.time
    ) -> tuple[Store, Path | None]:
        """Open the database; a corrupt one is moved aside (`….corrupt-<time>`) for a fresh one.

        Refusing to start on a corrupt file would make systemd restart the daemon into the same
        failure forever; the old file is kept for inspection. Returns where it went, or None.
        """
        path = state_dir / DATABASE_NAME
        try:
            return cls(path), None
        except StateError as exc:
            code = getattr(exc.__cause__, "sqlite_errorcode", None)
            if code not in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB):
                raise
        aside = path.with_name(f"{path.name}.corrupt-{int(now())}")
        for suffix in ("", "-wal", "-shm"):
            with suppress(FileNotFoundError):
                Path(f"{path}{suffix}").replace(f"{aside}{suffix}")
        return cls(path), aside

    def close(self) -> None:
        """Close the connection."""
        with self.lock:
            self.connection.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One atomic write; errors become `StateError`."""
        with self.lock:
            yield from self._transaction()

    def _transaction(self) -> Iterator[sqlite3.Connection]:
        try:
            self.connection.execute("BEGIN IMMEDIATE")
            try:
                yield self.connection
            except BaseException:
                self.connection.execute("ROLLBACK")
                raise
            self.connection.execute("COMMIT")
        except sqlite3.Error as exc:
            if self.connection.in_transaction:
                self.connection.execute("ROLLBACK")
            raise StateError(f"{self.path}: write failed: {exc}") from exc

    def load_checkpoint(self) -> Checkpoint:
        """The saved checkpoint, or an empty one."""
        rows = dict(self.query("SELECT key, value FROM meta WHERE key IN ('cursor','replay')"))
        return Checkpoint(cursor=rows.get("cursor"), replay_from=rows.get("replay"))

    def load_unit_states(self) -> dict[str, dict[str, Any]]:
        """The policy's saved memory per unit."""
        return {u: json.loads(s) for u, s in self.query("SELECT unit, state FROM unit_state")}

    def commit_batch(
        self,
        *,
        checkpoint: Checkpoint,
        outcomes: Sequence[Outcome] = (),
        unit_states: Mapping[str, Mapping[str, Any]] | None = None,
        extra: Sequence[Writer] = (),
        now: Callable[[], float] = time.time,
        decided: Sequence[Outcome] = (),
    ) -> None:
        """Commit everything one batch changed, atomically: the actions it `decided` (pending),
        the `outcomes` whose actions were taken (history; their pending actions cleared)."""
        with self.transaction() as db:
            db.executemany(
                "INSERT OR IGNORE INTO pending_action (unit, key, outcome) VALUES (?, ?, ?)",
                [(o.invocation.unit, _key(o), _dump(outcome_record(o))) for o in decided],
            )
            db.executemany(
                "DELETE FROM pending_action WHERE unit IS ? AND key = ?",
                [(o.invocation.unit, _key(o)) for o in outcomes],
            )
            for key, value in (("cursor", checkpoint.cursor), ("replay", checkpoint.replay_from)):
                if value is None:
                    db.execute("DELETE FROM meta WHERE key = ?", (key,))
                else:
                    db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
            for unit, state in (unit_states or {}).items():
                db.execute("INSERT OR REPLACE INTO unit_state VALUES (?, ?)", (unit, _dump(state)))
            for outcome in outcomes:
                inv = outcome.invocation
                db.execute(
                    "INSERT OR IGNORE INTO history (unit, invocation_id, time, outcome) "
                    "VALUES (?, ?, ?, ?)",
                    (inv.unit, inv.invocation_id, now(), _dump(outcome.to_json())),
                )
            for write in extra:
                write(db)

    def pending_actions(self) -> tuple[list[Outcome], list[str]]:
        """The actions decided and not yet taken, oldest first; and one line for each record
        that cannot be read (it stays, for a person to look at)."""
        rows = self.query("SELECT unit, key, outcome FROM pending_action ORDER BY id")
        outcomes, unreadable = [], []
        for unit, key, text in rows:
            try:
                outcomes.append(outcome_from_record(json.loads(text)))
            except (ValueError, KeyError, TypeError) as exc:
                unreadable.append(f"{unit} {key}: {type(exc).__name__}: {exc}")
        return outcomes, unreadable

    def add_note(self, unit: str | None, invocation_ids: Sequence[str], note: str) -> None:
        """Append `note` to the verdict notes of invocations already recorded (a late fact)."""
        with self.transaction() as db:
            for invocation_id in invocation_ids:
                row = db.execute(
                    "SELECT id, outcome FROM history WHERE unit IS ? AND invocation_id = ?",
                    (unit, invocation_id),
                ).fetchone()
                if row is None:
                    continue
                outcome = json.loads(row[1])
                notes = outcome.setdefault("verdict", {}).setdefault("notes", [])
                if note not in notes:
                    notes.append(note)
                db.execute("UPDATE history SET outcome = ? WHERE id = ?", (_dump(outcome), row[0]))

    def history(self, unit: str | None = None) -> list[dict[str, Any]]:
        """Every classified invocation, oldest first: the triage JSON plus time and notified."""
        sql = "SELECT time, outcome, notified FROM history"
        args: tuple[Any, ...] = ()
        if unit is not None:
            sql += " WHERE unit = ?"
            args = (unit,)
        result = []
        for when, outcome, notified in self.query(sql + " ORDER BY id", args):
            item = json.loads(outcome)
            item["time"] = datetime.fromtimestamp(when, UTC).isoformat()
            item["notified"] = bool(notified)
            result.append(item)
        return result

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Rows of a read; errors become `StateError`."""
        with self.lock:
            try:
                return self.connection.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise StateError(f"{self.path}: read failed: {exc}") from exc


def mark_notified(
    db: sqlite3.Connection, invocations: Iterable[tuple[str | None, str | None]]
) -> None:
    """Mark recorded invocations (unit, invocation id) as told, inside the caller's transaction
    (the outbox marks its message sent in the same one)."""
    db.executemany(
        "UPDATE history SET notified = 1 WHERE unit IS ? AND invocation_id IS ?",
        list(invocations),
    )


def _key(outcome: Outcome) -> str:
    """What identifies an invocation of its unit: its id, else its last entry's cursor."""
    inv = outcome.invocation
    return inv.invocation_id or f"cursor:{inv.last_cursor}"


def _read_only_uri(path: Path) -> str:
    # A read-only connection to a WAL database makes its -wal and -shm files when they are
    # missing (files a reader must not own); with neither there (the daemon closed cleanly)
    # the main file is the whole database and is read as immutable, which needs neither.
    uri = f"{path.absolute().as_uri()}?mode=ro"
    live = all(Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-shm"))
    return uri if live else f"{uri}&immutable=1"


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
