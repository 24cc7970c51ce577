"""The outbox's SQL: messages and the crashes they tell, in the state database, per sink.

Pure storage (`OutboxTable`, the tables' repository, and `OutboxQueue`, one sink's view through
the store's writer and reader), no timing and no delivery (supervisor.notify.outbox runs the
loop). Every row belongs to one sink (`sink`): each sink's queue is its own, in one table. A
crash is a member of exactly one message per sink (`outbox_member`, unique per sink, unit and
dedupe key, so a replayed batch queues nothing twice, and a second sink queues its own); a
group's pending message takes its later crashes. Marking a message sent marks its crashes
notified in the history (`History`) in the same transaction, so "sent" and "notified" never
disagree (a crash is notified once any sink delivered it). The tables are made by
supervisor.migrations.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from ..errors import StateError
from ..model import Outcome
from ..state.tables import History
from ..store import Store
from ..util.jsontext import loads
from .decision import Group, dedupe_key, group_key

MemberKey = tuple[str, str]  # (unit or "", dedupe key): one crash in outbox_member
Render = Callable[[Group | None], Any]
Resent = Callable[[Any], Any]  # a payload marked as possibly sent before (Sink.resent)
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True, kw_only=True)
class QueuedMessage:
    """A pending message as the delivery loop sees it."""

    id: int
    due: float
    attempts: int
    payload: str


_NEXT = (
    "SELECT id, due, attempts, payload FROM outbox WHERE sink = ? AND state = 'pending'"
    " AND id NOT IN (SELECT value FROM json_each(?)) ORDER BY due, id LIMIT 1"
)
_NEXT_NOT_A_NUMBER = _NEXT.replace("'pending'", "'pending' AND due >= ''")


class OutboxTable:
    """`outbox` and `outbox_member`: the repository of one sink's rows, over a connection."""

    TABLES: ClassVar[tuple[str, ...]] = ("outbox", "outbox_member")

    def __init__(self, db: sqlite3.Connection, sink: str) -> None:
        self._db = db
        self.sink = sink

    def interrupted(self, resent: Resent) -> int:
        """Pending again, marked by `resent`: the messages a run was sending when it ended."""
        db = self._db
        rows = db.execute(
            "SELECT id, payload FROM outbox WHERE sink = ? AND state = 'sending'", (self.sink,)
        ).fetchall()
        for message_id, payload in rows:
            try:
                marked = dump(resent(loads(payload)))
            except ValueError:
                marked = payload  # unrenderable: the delivery loop drops it with one line
            db.execute(
                "UPDATE outbox SET state = 'pending', payload = ?,"
                " last_error = 'interrupted' WHERE id = ?",
                (marked, message_id),
            )
        return len(rows)

    def sending(self, message_id: int) -> None:
        self._db.execute(
            "UPDATE outbox SET state = 'sending' WHERE id = ? AND state = 'pending'",
            (message_id,),
        )

    def add(
        self,
        outcome: Outcome,
        *,
        now: float,
        due: float,
        group_interval_s: float,
        inflight: int | None,
        render: Render,
        sent_at: float | None = None,
    ) -> str | None:
        """Queue the crash in a new or its group's open message: "queued", "grouped", or None
        for a crash already queued (a replay).

        `due` is when a new message may go out; `sent_at`, when the crash was already announced
        from memory (the database was full then): its message is recorded as sent."""
        db, inv = self._db, outcome.invocation
        when = inv.ended_us / 1_000_000 if inv.ended_us else now
        member = db.execute(
            "INSERT OR IGNORE INTO outbox_member"
            " (sink, message_id, unit, invocation_id, dedupe_key, time) VALUES (?, 0, ?, ?, ?, ?)",
            (self.sink, inv.unit, inv.invocation_id, dedupe_key(outcome), when),
        )
        if member.rowcount == 0:
            return None
        key = group_key(outcome)
        message_id = self._open_group(key, inflight)
        added = "grouped"
        if message_id is None:
            message_id = self._new_message(key, now, due, group_interval_s)
            added = "queued"
        db.execute(
            "UPDATE outbox_member SET message_id = ? WHERE id = ?", (message_id, member.lastrowid)
        )
        group = self._group(message_id, group_interval_s) if key else None
        db.execute("UPDATE outbox SET payload = ? WHERE id = ?", (dump(render(group)), message_id))
        if sent_at is not None:
            db.execute(
                "UPDATE outbox SET state = 'sent', sent_at = ?, attempts = 1 WHERE id = ?",
                (sent_at, message_id),
            )
            History(db).mark_notified([(inv.unit, inv.invocation_id)])
        return added

    def _open_group(self, key: str | None, inflight: int | None) -> int | None:
        """The pending message this group's next crash joins (never the one being sent)."""
        if key is None:
            return None
        row = self._db.execute(
            "SELECT id FROM outbox WHERE sink = ? AND group_key = ? AND state = 'pending'"
            " AND id IS NOT ? ORDER BY id LIMIT 1",
            (self.sink, key, inflight),
        ).fetchone()
        return None if row is None else int(row[0])

    def _new_message(self, key: str | None, now: float, due: float, interval_s: float) -> int:
        """A new pending message; a group's is due one interval after the group's previous one."""
        if key is not None:
            (last,) = self._db.execute(
                "SELECT max(CASE WHEN state = 'sent' THEN sent_at ELSE created END)"
                " FROM outbox WHERE sink = ? AND group_key = ?",
                (self.sink, key),
            ).fetchone()
            if last is not None:
                due = max(now, float(last) + interval_s)
        cursor = self._db.execute(
            "INSERT INTO outbox (sink, group_key, created, due, payload) VALUES (?, ?, ?, ?, '{}')",
            (self.sink, key, now, due),
        )
        return int(cursor.lastrowid or 0)

    def _group(self, message_id: int, interval_s: float) -> Group:
        count, first, last = self._db.execute(
            "SELECT count(*), min(time), max(time) FROM outbox_member WHERE message_id = ?",
            (message_id,),
        ).fetchone()
        return Group(count=int(count), first=float(first), last=float(last), interval_s=interval_s)

    def record_sent(self, message_id: int, sent_at: float) -> None:
        """The message sent and its crashes notified (in the caller's transaction)."""
        self._db.execute(
            "UPDATE outbox SET state = 'sent', sent_at = ?, attempts = attempts + 1,"
            " last_error = NULL WHERE id = ?",
            (sent_at, message_id),
        )
        members = self._db.execute(
            "SELECT unit, invocation_id FROM outbox_member"
            " WHERE message_id = ? AND invocation_id IS NOT NULL",
            (message_id,),
        ).fetchall()
        History(self._db).mark_notified(members)

    def update(self, message_id: int, attempts: int, state: str, due: float, error: str) -> None:
        self._db.execute(
            "UPDATE outbox SET attempts = ?, state = ?, due = ?, last_error = ? WHERE id = ?",
            (attempts, state, due, error, message_id),
        )

    def prune(self, horizon: float) -> None:
        self._db.execute(
            "DELETE FROM outbox_member WHERE message_id IN (SELECT id FROM outbox"
            " WHERE sink = ? AND state != 'pending' AND created < ?)",
            (self.sink, horizon),
        )
        self._db.execute(
            "DELETE FROM outbox WHERE sink = ? AND state != 'pending' AND created < ?",
            (self.sink, horizon),
        )

    def next_due(self, skip: list[int]) -> QueuedMessage | None:
        # A due that is not a number (a row edited by hand) is due now (_message), so it comes
        # first. SQLite orders NULL, then numbers, then text and blobs: the text and blobs are
        # asked for first, and each question is a range of the (sink, state, due) index, not a
        # sort of every pending row (which an expression in ORDER BY made SQLite do).
        for query in (_NEXT_NOT_A_NUMBER, _NEXT):
            row = self._db.execute(query, (self.sink, json.dumps(skip))).fetchone()
            if row is not None:
                return _message(row)
        return None

    def of_member(self, member: MemberKey) -> QueuedMessage | None:
        return _message(
            self._db.execute(
                "SELECT o.id, o.due, o.attempts, o.payload FROM outbox o JOIN outbox_member m"
                " ON m.message_id = o.id WHERE m.sink = ? AND ifnull(m.unit, '') = ?"
                " AND m.dedupe_key = ?",
                (self.sink, *member),
            ).fetchone()
        )

    def backlog(self, now: float) -> tuple[int, float | None]:
        count, overdue = self._db.execute(
            "SELECT count(*), ? - min(due) FROM outbox"
            " WHERE sink = ? AND state IN ('pending', 'sending')",
            (now, self.sink),
        ).fetchone()
        return int(count), overdue


class OutboxQueue:
    """One sink's rows of the outbox tables, through the store's writer and reader: writes are
    awaited (the writer's thread), reads are the reader's."""

    def __init__(self, store: Store, sink: str = "slack") -> None:
        self._store = store
        self.sink = sink
        store.register(OutboxTable)

    async def interrupted(self, resent: Resent) -> int:
        """Messages a previous run was sending when it ended (killed between the POST and
        recording its answer): the far end may have them. They go out again, marked by
        `resent`, rather than not at all; the count of them."""
        return await self._store.write(lambda db: OutboxTable(db, self.sink).interrupted(resent))

    async def sending(self, message_id: int) -> None:
        """The POST of this message begins: a restart from here on finds it `sending`."""
        await self._store.write(lambda db: OutboxTable(db, self.sink).sending(message_id))

    def table(self, db: sqlite3.Connection) -> OutboxTable:
        """This sink's outbox inside the caller's unit of work (the batch's transaction)."""
        return OutboxTable(db, self.sink)

    def next_due(self, skip: list[int]) -> QueuedMessage | None:
        """The pending message due first, leaving out `skip` (sent, not yet recorded)."""
        return self._read(lambda table: table.next_due(skip))

    def of_member(self, member: MemberKey) -> QueuedMessage | None:
        """The message a crash is queued in, once its batch is committed; None before."""
        try:
            return self._read(lambda table: table.of_member(member))
        except StateError:
            return None

    async def record_sent(self, message_id: int, sent_at: float) -> None:
        """Mark the message sent and its crashes notified, in one transaction."""
        await self._store.write(
            lambda db: OutboxTable(db, self.sink).record_sent(message_id, sent_at)
        )

    async def update(
        self, message_id: int, attempts: int, state: str, due: float, error: str
    ) -> None:
        """After a failed attempt: its count, `pending` or `failed`, and the bounded reason."""
        await self._store.write(
            lambda db: OutboxTable(db, self.sink).update(message_id, attempts, state, due, error)
        )

    async def prune(self, horizon: float) -> None:
        """Forget this sink's delivered and failed messages created before `horizon`."""
        await self._store.write(lambda db: OutboxTable(db, self.sink).prune(horizon))

    def depth(self) -> int:
        """Messages waiting for delivery (the one being sent included)."""
        return self.backlog(0.0)[0]

    def backlog(self, now: float) -> tuple[int, float | None]:
        """Pending messages, and how long the oldest due one is overdue (None: none pending)."""
        return self._read(lambda table: table.backlog(now))

    def _read(self, read: Callable[[OutboxTable], _T]) -> _T:
        try:
            return self._store.read(lambda db: read(OutboxTable(db, self.sink)))
        except StateError as exc:
            raise StateError(f"cannot read the outbox: {exc}") from exc


def _message(row: Any) -> QueuedMessage | None:
    """A row as the delivery loop reads it. The database is a file: a value of another type
    (a row edited by hand) is due now, at no attempts yet, or a payload that is not JSON (which
    the loop drops with one line), never a TypeError that ends the loop."""
    if row is None:
        return None
    message_id, due, attempts, payload = row
    return QueuedMessage(
        id=message_id,
        due=float(due) if isinstance(due, int | float) and math.isfinite(due) else 0.0,
        attempts=min(attempts, 1 << 20) if isinstance(attempts, int) and attempts >= 0 else 0,
        payload=payload if isinstance(payload, str) else "",
    )


def dump(value: Any) -> str:
    """The stored form of a payload: compact, stable, unicode kept."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
