"""A durable outbox for Slack messages, in the supervisor's own SQLite database.

Queueing is a `Writer` that runs inside the batch's transaction (`Store.commit_batch`), so a
message exists exactly when the crash it reports is recorded. `Outbox.run` delivers pending
messages, marks the crashes `notified` in the history in the same transaction that marks the
message sent, and survives supervisor restarts: each crash is announced once. (Only a crash of
the supervisor between Slack's 200 and that commit can repeat a message: at-least-once at the
wire, exactly-once in the database.)

Transient crashes of one unit+signature are grouped: the first is announced at once, later ones
are folded into one message per `group_interval_s` that carries their count (Alertmanager's
group_wait=0 / group_interval). Delivery is paced to one message per `min_interval_s`, retried
with capped exponential backoff and jitter, honours Slack's Retry-After, and gives up after
`max_attempts` (Alertmanager's RetryStage, with a cap on attempts as well as time).
"""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from supervisor.aio import first_of
from supervisor.config import SlackConfig
from supervisor.errors import NotifyError, StateError
from supervisor.metrics import Metrics
from supervisor.model import Outcome
from supervisor.notify.slack import (
    Group,
    SlackRateLimited,
    SlackWebhook,
    build_payload,
    coerce_action_taken,
    is_groupable,
    is_notable,
)
from supervisor.store import Store, Writer

_SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY,
    group_key TEXT,                         -- unit NUL signature; NULL: never grouped
    created REAL NOT NULL,
    due REAL NOT NULL,                      -- not before this unix time
    attempts INTEGER NOT NULL DEFAULT 0,
    state TEXT NOT NULL DEFAULT 'pending',  -- pending | sent | failed
    sent_at REAL,
    payload TEXT NOT NULL,                  -- the Slack JSON body
    last_error TEXT                         -- a bounded reason, never the URL
);
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (state, due);
CREATE TABLE IF NOT EXISTS outbox_member (
    id INTEGER PRIMARY KEY,
    message_id INTEGER NOT NULL,
    unit TEXT,
    invocation_id TEXT,
    dedupe_key TEXT,                        -- invocation id (or cursor); NULL: no dedupe
    time REAL NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS outbox_member_key
    ON outbox_member (ifnull(unit, ''), dedupe_key);
CREATE INDEX IF NOT EXISTS outbox_member_message ON outbox_member (message_id);
"""

BACKOFF_BASE_S = 1.0
RETENTION_S = 7 * 86400.0  # delivered and failed messages are kept this long for inspection
STATE_RETRY_S = 5.0  # wait after a state database error before trying again
MAX_HEALTHY_DEPTH = 100
MAX_CONSECUTIVE_FAILURES = 3

Sleep = Callable[[float], Awaitable[Any]]

_log = structlog.get_logger()


@dataclass(frozen=True, slots=True, kw_only=True)
class _Message:
    id: int
    due: float
    attempts: int
    payload: str


def _noop(db: sqlite3.Connection) -> None:
    """A writer with nothing to queue."""


class Outbox:
    """Queues crash messages atomically with their batch and delivers them to one webhook."""

    def __init__(
        self,
        store: Store,
        webhook: SlackWebhook | None,
        metrics: Metrics,
        config: SlackConfig,
        *,
        host: str,
        now: Callable[[], float] = time.time,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self._store = store
        self._webhook = webhook
        self._metrics = metrics
        self._config = config
        self._host = host
        self._now = now
        self._sleep = sleep
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        self._wake = asyncio.Event()
        self._inflight: int | None = None
        self._next_send_at = 0.0
        self._last_error: str | None = None
        self._consecutive_failures = 0
        try:
            store.connection.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise StateError(f"{store.path}: cannot create the outbox tables: {exc}") from exc

    # -- queueing (inside the batch transaction) ----------------------------------------------

    def writer_for(self, outcome: Outcome, *, action_taken: str) -> Writer:
        """A writer for `Store.commit_batch(extra=[...])` that queues this crash's message."""
        if self._webhook is None or not is_notable(outcome):
            return _noop
        if is_groupable(outcome) and not self._config.notify_transient:
            self._metrics.notification("dropped")
            return _noop

        action = coerce_action_taken(action_taken, outcome.decision)

        def write(db: sqlite3.Connection) -> None:
            self._queue(db, outcome, action)

        return write

    def _queue(self, db: sqlite3.Connection, outcome: Outcome, action_taken: str) -> None:
        """Add the crash as a member of a new or an open group message; ignore a replay."""
        now, inv = self._now(), outcome.invocation
        when = inv.ended_us / 1_000_000 if inv.ended_us else now
        key = inv.invocation_id or (f"cursor:{inv.last_cursor}" if inv.last_cursor else None)
        member = db.execute(
            "INSERT OR IGNORE INTO outbox_member"
            " (message_id, unit, invocation_id, dedupe_key, time) VALUES (0, ?, ?, ?, ?)",
            (inv.unit, inv.invocation_id, key, when),
        )
        if member.rowcount == 0:
            return  # this invocation is already queued: a replayed batch
        group_key = f"{inv.unit}\x00{outcome.verdict.signature}" if is_groupable(outcome) else None
        message_id = self._open_group(db, group_key)
        if message_id is None:
            message_id = self._new_message(db, group_key, now)
            self._metrics.notification("queued")
        else:
            self._metrics.notification("grouped")
        db.execute(
            "UPDATE outbox_member SET message_id = ? WHERE id = ?", (message_id, member.lastrowid)
        )
        payload = build_payload(
            outcome,
            host=self._host,
            action_taken=action_taken,
            group=self._group(db, message_id) if group_key else None,
        )
        db.execute("UPDATE outbox SET payload = ? WHERE id = ?", (_dump(payload), message_id))
        # The run loop cannot see the row before this synchronous commit returns, so waking
        # it now is safe; after a rollback it simply finds nothing new.
        self._wake.set()

    def _open_group(self, db: sqlite3.Connection, group_key: str | None) -> int | None:
        """The pending message this group's next crash joins (never the one being sent)."""
        if group_key is None:
            return None
        row = db.execute(
            "SELECT id FROM outbox WHERE group_key = ? AND state = 'pending' AND id IS NOT ?"
            " ORDER BY id LIMIT 1",
            (group_key, self._inflight),
        ).fetchone()
        return None if row is None else int(row[0])

    def _new_message(self, db: sqlite3.Connection, group_key: str | None, now: float) -> int:
        """A new pending message; a group's is due one interval after the group's previous one."""
        due = now
        if group_key is not None:
            (last,) = db.execute(
                "SELECT max(CASE WHEN state = 'sent' THEN sent_at ELSE created END)"
                " FROM outbox WHERE group_key = ?",
                (group_key,),
            ).fetchone()
            if last is not None:
                due = max(now, float(last) + self._config.group_interval_s)
        cursor = db.execute(
            "INSERT INTO outbox (group_key, created, due, payload) VALUES (?, ?, ?, '{}')",
            (group_key, now, due),
        )
        return int(cursor.lastrowid or 0)

    def _group(self, db: sqlite3.Connection, message_id: int) -> Group:
        count, first, last = db.execute(
            "SELECT count(*), min(time), max(time) FROM outbox_member WHERE message_id = ?",
            (message_id,),
        ).fetchone()
        return Group(
            count=int(count),
            first=float(first),
            last=float(last),
            interval_s=self._config.group_interval_s,
        )

    # -- inspection -------------------------------------------------------------------------

    def wake(self) -> None:
        """Look at the queue now (e.g. after a commit that queued a message)."""
        self._wake.set()

    def depth(self) -> int:
        """Messages waiting for delivery."""
        try:
            row = self._store.connection.execute(
                "SELECT count(*) FROM outbox WHERE state = 'pending'"
            ).fetchone()
        except sqlite3.Error as exc:
            raise StateError(f"{self._store.path}: cannot read the outbox: {exc}") from exc
        return int(row[0])

    def health(self) -> tuple[bool, dict[str, Any]]:
        """For /healthz: unhealthy on a backlog, repeated failures or a stuck queue."""
        if self._webhook is None:
            return True, {"slack": "off", "reasons": []}
        try:
            depth, overdue = self._store.connection.execute(
                "SELECT count(*), ? - min(due) FROM outbox WHERE state = 'pending'", (self._now(),)
            ).fetchone()
        except sqlite3.Error as exc:
            return False, {"outbox_depth": None, "reasons": [f"outbox unreadable: {exc}"]}
        reasons = []
        if depth > MAX_HEALTHY_DEPTH:
            reasons.append(f"outbox backlog: {depth} messages")
        if self._consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
            reasons.append(f"slack failing: {self._last_error}")
        if overdue is not None and overdue > self._config.backoff_max_s + 60:
            reasons.append(f"outbox stuck: oldest message {overdue:.0f}s overdue")
        return not reasons, {"outbox_depth": depth, "reasons": reasons}

    # -- delivery ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Deliver pending messages until `stop` is set; state errors are logged and retried."""
        if self._webhook is None:
            await stop.wait()
            return
        self._prune()
        while not stop.is_set():
            self._wake.clear()
            try:
                await self._step(stop)
            except StateError as exc:
                self._metrics.state_error("write")
                _log.error("outbox_state_error", error=str(exc))
                await self._wait(stop, STATE_RETRY_S)

    async def _step(self, stop: asyncio.Event) -> None:
        """Deliver the next due message, or wait until one is due or new work arrives."""
        message = self._next()
        self._metrics.outbox_depth(self.depth())
        if message is None:
            await self._wait(stop, None)
            return
        wait_s = max(message.due, self._next_send_at) - self._now()
        if wait_s > 0:
            await self._wait(stop, wait_s)
            return
        await self._deliver(message)

    def _next(self) -> _Message | None:
        try:
            row = self._store.connection.execute(
                "SELECT id, due, attempts, payload FROM outbox WHERE state = 'pending'"
                " ORDER BY due, id LIMIT 1"
            ).fetchone()
        except sqlite3.Error as exc:
            raise StateError(f"{self._store.path}: cannot read the outbox: {exc}") from exc
        if row is None:
            return None
        return _Message(id=row[0], due=row[1], attempts=row[2], payload=row[3])

    async def _wait(self, stop: asyncio.Event, seconds: float | None) -> None:
        """Until `stop`, `wake()` or `seconds` (the injected sleep), whichever comes first."""
        waits: list[Awaitable[object]] = [stop.wait(), self._wake.wait()]
        if seconds is not None:
            waits.append(self._sleep(seconds))
        await first_of(*waits)

    async def _deliver(self, message: _Message) -> None:
        assert self._webhook is not None  # noqa: S101 - run() returns early without one
        self._inflight = message.id
        try:
            async with asyncio.timeout(self._config.timeout_s + 5):
                await self._webhook.send(json.loads(message.payload))
        except NotifyError as exc:
            self._failed(message, exc)
        except TimeoutError:
            error = NotifyError("slack: timeout: no answer", reason="timeout", retryable=True)
            self._failed(message, error)
        else:
            self._delivered(message)
        finally:
            self._inflight = None

    def _delivered(self, message: _Message) -> None:
        """Mark the message sent and its crashes notified, in one transaction."""
        now = self._now()
        self._next_send_at = now + self._config.min_interval_s
        with self._store.transaction() as db:
            db.execute(
                "UPDATE outbox SET state = 'sent', sent_at = ?, attempts = attempts + 1,"
                " last_error = NULL WHERE id = ?",
                (now, message.id),
            )
            # The same update as Store.mark_notified, inside this transaction so "sent" and
            # "notified" can never disagree.
            db.execute(
                "UPDATE history SET notified = 1 WHERE EXISTS (SELECT 1 FROM outbox_member m"
                " WHERE m.message_id = ? AND m.invocation_id IS NOT NULL"
                " AND m.unit IS history.unit AND m.invocation_id = history.invocation_id)",
                (message.id,),
            )
        self._metrics.notification("sent")
        if self._last_error is not None:
            _log.info("slack_delivery_recovered", attempts=message.attempts + 1)
        self._last_error, self._consecutive_failures = None, 0

    def _failed(self, message: _Message, exc: NotifyError) -> None:
        """Schedule a retry, or give the message up when it is permanent or out of attempts."""
        now, attempts = self._now(), message.attempts + 1
        self._next_send_at = now + self._config.min_interval_s
        self._consecutive_failures += 1
        if isinstance(exc, SlackRateLimited) and exc.retry_after is not None:
            self._next_send_at = max(self._next_send_at, now + exc.retry_after)
        if exc.retryable and attempts < self._config.max_attempts:
            delay = self._backoff(attempts, exc)
            self._update(message.id, attempts, "pending", now + delay, exc.reason)
            self._metrics.notification("retried")
            if str(exc) != self._last_error:
                _log.warning(
                    "slack_delivery_failed", error=str(exc), attempt=attempts, retry_in_s=delay
                )
        else:
            self._update(message.id, attempts, "failed", now, exc.reason)
            self._metrics.notification("failed")
            _log.error(
                "slack_message_dropped", error=str(exc), reason=exc.reason, attempts=attempts
            )
        self._last_error = str(exc)

    def _backoff(self, attempts: int, exc: NotifyError) -> float:
        """Capped exponential backoff with jitter; at least Slack's Retry-After."""
        cap = self._config.backoff_max_s
        delay = min(cap, BACKOFF_BASE_S * 2.0 ** (attempts - 1))
        delay = delay / 2 + self._rng.uniform(0, delay / 2)
        if isinstance(exc, SlackRateLimited) and exc.retry_after is not None:
            delay = max(delay, min(cap, exc.retry_after))
        return delay

    def _update(self, message_id: int, attempts: int, state: str, due: float, error: str) -> None:
        with self._store.transaction() as db:
            db.execute(
                "UPDATE outbox SET attempts = ?, state = ?, due = ?, last_error = ? WHERE id = ?",
                (attempts, state, due, error, message_id),
            )

    def _prune(self) -> None:
        """Forget delivered and failed messages past the retention period."""
        horizon = self._now() - RETENTION_S
        with self._store.transaction() as db:
            db.execute(
                "DELETE FROM outbox_member WHERE message_id IN (SELECT id FROM outbox"
                " WHERE state != 'pending' AND created < ?)",
                (horizon,),
            )
            db.execute("DELETE FROM outbox WHERE state != 'pending' AND created < ?", (horizon,))


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
