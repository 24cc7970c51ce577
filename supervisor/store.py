"""The state database (SQLite): journal checkpoint, policy state, crash history, outbox.

Its schema is versioned (supervisor.migrations): opening a database upgrades it. One writer
owns it (supervisor.state.writer): every write is a unit of work run as one transaction in the
writer's thread, awaited by the loop (`acommit_batch`, `write`) or, off the loop, waited for
(`commit_batch`, `write_blocking`). Reads use a second connection (supervisor.state.reader).
Each table has one repository, registered with the writer (`register`).

Everything one handled batch changes is committed in **one transaction**: the new cursor and
the invocations it ended (each pending, to be decided). A crash of the supervisor at any point
therefore either keeps all of a batch or none of it, and the batch is read again from the
previous cursor: every entry is handled exactly once. An invocation is decided after its batch,
in its unit's lane (the pending record becomes the decision, committed with the policy's
per-unit memory), then acted on; what was done (`taken`) is committed with the invocation's
history and the notifications it queued, in one transaction that also clears the pending
record. A supervisor that dies in between finds it pending at its next start
(`pending_actions`): to be decided, or to be acted on.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any, TypeVar

from .errors import StateError
from .migrations import migrate
from .model import Ended, Outcome
from .records import Pending
from .state.reader import StateReader
from .state.tables import STORE_TABLES, Checkpoint, History, Meta, PendingActions, UnitStateTable
from .state.writer import Repository, StateWriter, Work
from .util.files import make_dirs, private_file

__all__ = ["DATABASE_NAME", "Checkpoint", "Store", "Writer"]

DATABASE_NAME = "state.sqlite3"

T = TypeVar("T")

Writer = Callable[[sqlite3.Connection], None]
"""Extra work to run inside a batch's transaction (e.g. queueing notifications)."""


class Store:
    """One SQLite database in the state directory: its writer, its reader, its tables."""

    writer: StateWriter | None  # None when opened read-only

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            make_dirs(path.parent)
            # SQLite gives the -wal and -shm files the mode of the database file itself.
            for suffix in ("", "-wal", "-shm"):
                if not suffix or Path(f"{path}{suffix}").exists():
                    private_file(Path(f"{path}{suffix}"))
            connection = sqlite3.connect(
                path, isolation_level=None, timeout=10, check_same_thread=False
            )
            try:
                connection.execute("PRAGMA journal_mode=WAL")
                # FULL: a committed cursor survives power loss, not only a crash of the process.
                connection.execute("PRAGMA synchronous=FULL")
                migrate(connection, path)
                reader = sqlite3.connect(
                    path, isolation_level=None, timeout=10, check_same_thread=False
                )
            except BaseException:
                connection.close()
                raise
        except sqlite3.Error as exc:
            raise StateError(f"{path}: cannot open the state database: {exc}") from exc
        except OSError as exc:
            raise StateError(f"{path.parent}: cannot create the state directory: {exc}") from exc
        self.writer = StateWriter(connection, path)
        self.reader = StateReader(reader, path)
        for repository in STORE_TABLES:
            self.register(repository)

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
        try:
            connection = sqlite3.connect(
                _read_only_uri(path), uri=True, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise StateError(f"{path}: cannot read the state database: {exc}") from exc
        store = cls.__new__(cls)
        store.path, store.writer = path, None
        try:
            store.reader = StateReader(connection, path)
            store.reader.query("SELECT count(*) FROM sqlite_master")
        except (sqlite3.Error, StateError) as exc:
            connection.close()
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
        """Finish the writes queued; close both connections."""
        if self.writer is not None:
            self.writer.close()
        self.reader.close()

    # -- the one way in --------------------------------------------------------------------

    def register(self, repository: type[Repository]) -> None:
        """`repository` is the owner of its tables (StateError: a second owner, or a table the
        migrations never made)."""
        if self.writer is not None:
            self.writer.register(repository, self.reader.tables())
        else:
            missing = set(repository.TABLES) - self.reader.tables()
            if missing:
                raise StateError(f"{self.path}: no table {', '.join(sorted(missing))}")

    async def write(self, work: Work[T]) -> T:
        """Run `work` as one transaction in the writer's thread (the loop goes on meanwhile)."""
        return await self._writer().write(work)

    def write_blocking(self, work: Work[T]) -> T:
        """`write`, waited for: for a caller that is not the event loop."""
        return self._writer().write_blocking(work)

    def after_commit(self, callback: Callable[[], None]) -> None:
        """From inside a unit of work: `callback` once it is committed (in the writer's thread)."""
        self._writer().after_commit(callback)

    def read(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """What `work` reads with the read connection; errors become `StateError`."""
        return self.reader.read(work)

    def query(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Rows of a read; errors become `StateError`."""
        return self.reader.query(sql, args)

    def _writer(self) -> StateWriter:
        if self.writer is None:
            raise StateError(f"{self.path}: opened read-only")
        return self.writer

    # -- the store's own tables ------------------------------------------------------------

    def load_checkpoint(self) -> Checkpoint:
        """The saved checkpoint, or an empty one."""
        return self.read(lambda db: Meta(db).checkpoint())

    def load_unit_states(self) -> dict[str, dict[str, Any]]:
        """The policy's saved memory per unit."""
        return self.read(lambda db: UnitStateTable(db).load())

    def commit_batch(
        self,
        *,
        checkpoint: Checkpoint,
        outcomes: Sequence[Outcome] = (),
        unit_states: Mapping[str, Mapping[str, Any]] | None = None,
        extra: Sequence[Writer] = (),
        now: Callable[[], float] = time.time,
        decided: Sequence[Outcome] = (),
        ended: Sequence[Ended] = (),
    ) -> None:
        """`acommit_batch`, waited for (off the loop)."""
        self.write_blocking(
            _batch(checkpoint, outcomes, unit_states or {}, extra, now, decided, ended)
        )

    async def acommit_batch(
        self,
        *,
        checkpoint: Checkpoint,
        outcomes: Sequence[Outcome] = (),
        unit_states: Mapping[str, Mapping[str, Any]] | None = None,
        extra: Sequence[Writer] = (),
        now: Callable[[], float] = time.time,
        decided: Sequence[Outcome] = (),
        ended: Sequence[Ended] = (),
        whole_memory: bool = False,
    ) -> None:
        """Commit everything noted since the last commit, atomically: the invocations that
        `ended` (pending, to be decided), the actions `decided` (the pending record becomes
        the outcome's), the `outcomes` whose actions were taken (history; their pending
        records cleared), the checkpoint, the policy's memory (`whole_memory`: all of it, a
        unit left out forgotten) and the `extra` writes (the messages queued)."""
        await self.write(
            _batch(
                checkpoint, outcomes, unit_states or {}, extra, now, decided, ended, whole_memory
            )
        )

    def pending_actions(self) -> tuple[list[Pending], list[str]]:
        """The invocations ended and not yet decided, and the actions decided and not yet
        taken, oldest first; and one line for each record that cannot be read (it stays, for
        a person to look at)."""
        return self.read(lambda db: PendingActions(db).load())

    def add_note(self, unit: str | None, invocation_ids: Sequence[str], note: str) -> None:
        """`aadd_note`, waited for (off the loop)."""
        self.write_blocking(lambda db: History(db).add_note(unit, invocation_ids, note))

    async def aadd_note(self, unit: str | None, invocation_ids: Sequence[str], note: str) -> None:
        """Append `note` to the verdict notes of invocations already recorded (a late fact)."""
        await self.write(lambda db: History(db).add_note(unit, invocation_ids, note))

    def history(self, unit: str | None = None) -> list[dict[str, Any]]:
        """Every classified invocation, oldest first: the triage JSON plus time and notified."""
        return self.read(lambda db: History(db).items(unit))


def _batch(
    checkpoint: Checkpoint,
    outcomes: Sequence[Outcome],
    unit_states: Mapping[str, Mapping[str, Any]],
    extra: Sequence[Writer],
    now: Callable[[], float],
    decided: Sequence[Outcome],
    ended: Sequence[Ended],
    whole_memory: bool = False,
) -> Writer:
    """One batch's unit of work."""

    def work(db: sqlite3.Connection) -> None:
        pending = PendingActions(db)
        pending.add(ended)
        pending.decide(decided)
        pending.clear(outcomes)
        Meta(db).save(checkpoint)
        UnitStateTable(db).save(unit_states, whole=whole_memory)
        History(db).add(outcomes, now())
        for write in extra:
            write(db)

    return work


def _read_only_uri(path: Path) -> str:
    # A read-only connection to a WAL database makes its -wal and -shm files when they are
    # missing (files a reader must not own); with neither there (the daemon closed cleanly)
    # the main file is the whole database and is read as immutable, which needs neither.
    uri = f"{path.absolute().as_uri()}?mode=ro"
    live = all(Path(f"{path}{suffix}").exists() for suffix in ("-wal", "-shm"))
    return uri if live else f"{uri}&immutable=1"
