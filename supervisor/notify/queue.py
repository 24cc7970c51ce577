"""The outbox's SQL: messages and the crashes they tell, in the state database, per sink.

Pure storage, no timing and no delivery (supervisor.notify.outbox runs the loop). Every row
belongs to one sink (`sink`): each sink's queue is its own, in one table. A crash is a member of
exactly one message per sink (`outbox_member`, unique per sink, unit and dedupe key, so a
replayed batch queues nothing twice, and a second sink queues its own); a group's pending
message takes its later crashes. Marking a message sent marks its crashes notified in the
history, through `Store`, in the same transaction, so "sent" and "notified" never disagree (a
crash is notified once any sink delivered it). The tables are made by supervisor.migrations.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import StateError
from ..model import Outcome
from ..store import Store, mark_notified
from .decision import Group, dedupe_key, group_key

MemberKey = tuple[str, str]  # (unit or "", dedupe key): one crash in outbox_member
Render = Callable[[Group | None], Any]
Resent = Callable[[Any], Any]  # a payload marked as possibly sent before (Sink.resent)


@dataclass(frozen=True, slots=True, kw_only=True)
class QueuedMessage:
    """A pending message as the delivery loop sees it."""

    id: int
    due: float
    attempts: int
    payload: str


class OutboxQueue:
    """One sink's rows of the outbox tables."""

    def __init__(self, store: Store, sink: str = "slack") -> None:
        self._store = store
        self.sink = sink

    def interrupted(self, resent: Resent) -> int:
        """Messages a previous run was sending when it ended (killed between the POST and
        recording its answer): the far end may have them. They go out again, marked by
        `resent`, rather than not at all; the count of them."""
        with self._store.transaction() as db:
            rows = db.execute(
                "SELECT id, payload FROM outbox WHERE sink = ? AND state = 'sending'", (self.sink,)
            ).fetchall()
            for message_id, payload in rows:
                try:
                    marked = dump(resent(json.loads(payload)))
                except ValueError:
                    marked = payload  # unrenderable: the delivery loop drops it with one line
                db.execute(
                    "UPDATE outbox SET state = 'pending', payload = ?,"
                    " last_error = 'interrupted' WHERE id = ?",
                    (marked, message_id),
                )
        return len(rows)

    def sending(self, message_id: int) -> None:
        """The POST of this message begins: a restart from here on finds it `sending`."""
        with self._store.transaction() as db:
            db.execute(
                "UPDATE outbox SET state = 'sending' WHERE id = ? AND state = 'pending'",
                (message_id,),
            )

    def add(
        self,
        db: sqlite3.Connection,
        outcome: Outcome,
        *,
        now: float,
        due: float,
        group_interval_s: float,
        inflight: int | None,
        render: Render,
        sent_at: float | None = None,
    ) -> str | None:
        """Queue the crash in a new or its group's open message, inside the caller's
        transaction: "queued", "grouped", or None for a crash already queued (a replay).

        `due` is when a new message may go out; `sent_at`, when the crash was already announced
        from memory (the database was full then): its message is recorded as sent."""
        inv = outcome.invocation
        when = inv.ended_us / 1_000_000 if inv.ended_us else now
        member = db.execute(
            "INSERT OR IGNORE INTO outbox_member"
            " (sink, message_id, unit, invocation_id, dedupe_key, time) VALUES (?, 0, ?, ?, ?, ?)",
            (self.sink, inv.unit, inv.invocation_id, dedupe_key(outcome), when),
        )
        if member.rowcount == 0:
            return None
        key = group_key(outcome)
        message_id = self._open_group(db, key, inflight)
        added = "grouped"
        if message_id is None:
            message_id = self._new_message(db, key, now, due, group_interval_s)
            added = "queued"
        db.execute(
            "UPDATE outbox_member SET message_id = ? WHERE id = ?", (message_id, member.lastrowid)
        )
        group = self._group(db, message_id, group_interval_s) if key else None
        db.execute("UPDATE outbox SET payload = ? WHERE id = ?", (dump(render(group)), message_id))
        if sent_at is not None:
            db.execute(
                "UPDATE outbox SET state = 'sent', sent_at = ?, attempts = 1 WHERE id = ?",
                (sent_at, message_id),
            )
            mark_notified(db, [(inv.unit, inv.invocation_id)])
        return added

    def _open_group(
        self, db: sqlite3.Connection, key: str | None, inflight: int | None
    ) -> int | None:
        """The pending message this group's next crash joins (never the one being sent)."""
        if key is None:
            return None
        row = db.execute(
            "SELECT id FROM outbox WHERE sink = ? AND group_key = ? AND state = 'pending'"
            " AND id IS NOT ? ORDER BY id LIMIT 1",
            (self.sink, key, inflight),
        ).fetchone()
        return None if row is None else int(row[0])

    def _new_message(
        self, db: sqlite3.Connection, key: str | None, now: float, due: float, interval_s: float
    ) -> int:
        """A new pending message; a group's is due one interval after the group's previous one."""
        if key is not None:
            (last,) = db.execute(
                "SELECT max(CASE WHEN state = 'sent' THEN sent_at ELSE created END)"
                " FROM outbox WHERE sink = ? AND group_key = ?",
                (self.sink, key),
            ).fetchone()
            if last is not None:
                due = max(now, float(last) + interval_s)
        cursor = db.execute(
            "INSERT INTO outbox (sink, group_key, created, due, payload) VALUES (?, ?, ?, ?, '{}')",
            (self.sink, key, now, due),
        )
        return int(cursor.lastrowid or 0)

    def _group(self, db: sqlite3.Connection, message_id: int, interval_s: float) -> Group:
        count, first, last = db.execute(
            "SELECT count(*), min(time), max(time) FROM outbox_member WHERE message_id = ?",
            (message_id,),
        ).fetchone()
        return Group(count=int(count), first=float(first), last=float(last), interval_s=interval_s)

    def next_due(self, skip: list[int]) -> QueuedMessage | None:
        """The pending message due first, leaving out `skip` (sent, not yet recorded)."""
        row = self._read(
            "SELECT id, due, attempts, payload FROM outbox WHERE sink = ? AND state = 'pending'"
            " AND id NOT IN (SELECT value FROM json_each(?)) ORDER BY due, id LIMIT 1",
            (self.sink, json.dumps(skip)),
        )
        return (
            None
            if row is None
            else QueuedMessage(id=row[0], due=row[1], attempts=row[2], payload=row[3])
        )

    def of_member(self, member: MemberKey) -> QueuedMessage | None:
        """The message a crash is queued in, once its batch is committed; None before."""
        try:
            row = self._read(
                "SELECT o.id, o.due, o.attempts, o.payload FROM outbox o JOIN outbox_member m"
                " ON m.message_id = o.id WHERE m.sink = ? AND ifnull(m.unit, '') = ?"
                " AND m.dedupe_key = ?",
                (self.sink, *member),
            )
        except StateError:
            return None
        return (
            None
            if row is None
            else QueuedMessage(id=row[0], due=row[1], attempts=row[2], payload=row[3])
        )

    def record_sent(self, message_id: int, sent_at: float) -> None:
        """Mark the message sent and its crashes notified, in one transaction."""
        with self._store.transaction() as db:
            db.execute(
                "UPDATE outbox SET state = 'sent', sent_at = ?, attempts = attempts + 1,"
                " last_error = NULL WHERE id = ?",
                (sent_at, message_id),
            )
            members = db.execute(
                "SELECT unit, invocation_id FROM outbox_member"
                " WHERE message_id = ? AND invocation_id IS NOT NULL",
                (message_id,),
            ).fetchall()
            mark_notified(db, members)

    def update(self, message_id: int, attempts: int, state: str, due: float, error: str) -> None:
        """After a failed attempt: its count, `pending` or `failed`, and the bounded reason."""
        with self._store.transaction() as db:
            db.execute(
                "UPDATE outbox SET attempts = ?, state = ?, due = ?, last_error = ? WHERE id = ?",
                (attempts, state, due, error, message_id),
            )

    def prune(self, horizon: float) -> None:
        """Forget this sink's delivered and failed messages created before `horizon`."""
        with self._store.transaction() as db:
            db.execute(
                "DELETE FROM outbox_member WHERE message_id IN (SELECT id FROM outbox"
                " WHERE sink = ? AND state != 'pending' AND created < ?)",
                (self.sink, horizon),
            )
            db.execute(
                "DELETE FROM outbox WHERE sink = ? AND state != 'pending' AND created < ?",
                (self.sink, horizon),
            )

    def depth(self) -> int:
        """Messages waiting for delivery (the one being sent included)."""
        row = self._read(
            "SELECT count(*) FROM outbox WHERE sink = ? AND state IN ('pending', 'sending')",
            (self.sink,),
        )
        return int(row[0]) if row is not None else 0

    def backlog(self, now: float) -> tuple[int, float | None]:
        """Pending messages, and how long the oldest due one is overdue (None: none pending)."""
        row = self._read(
            "SELECT count(*), ? - min(due) FROM outbox"
            " WHERE sink = ? AND state IN ('pending', 'sending')",
            (now, self.sink),
        )
        assert row is not None  # noqa: S101 - an aggregate always returns a row
        return int(row[0]), row[1]

    def _read(self, sql: str, args: tuple[Any, ...]) -> Any:
        try:
            with self._store.lock:
                return self._store.connection.execute(sql, args).fetchone()
        except sqlite3.Error as exc:
            raise StateError(f"{self._store.path}: cannot read the outbox: {exc}") from exc


def dump(value: Any) -> str:
    """The stored form of a payload: compact, stable, unicode kept."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
