"""The durable outbox's delivery loop for one edge-triggered sink: pacing, retries, holding
through a disk outage, health.

Whether a crash is told is `notify.decision`'s; the tables are `notify.queue`'s; what a message
says and how it is posted are the sink's (`notify.sink`: `render`, `send` -> `Result`); this
module times and sends, the same for every sink (Alertmanager's DedupStage + RetryStage, per
integration). Each sink has its own `Outbox` over its own rows, so a second sink is told about
the same crash with its own message, pacing and retries. Slack is the example below.

Queueing is a `Writer` that runs inside the batch's transaction (`Store.acommit_batch`, in the
state writer's thread), so a message exists exactly when the crash it reports is recorded.
`Outbox.run` delivers pending messages, marks the crashes `notified` in the history in the same
transaction that marks the message sent, and survives supervisor restarts: each crash is
announced once. (Only a crash of the supervisor between Slack's 200 and that commit can repeat a
message: at-least-once at the wire, exactly-once in the database; the message is marked
`sending` before its POST, so the repeat says it may be one.)

While the database cannot be written (disk full), alerting goes on from memory: a 200 whose
"sent" cannot be recorded is kept in memory (that message is not sent again) and recorded once
the database takes writes; a crash whose batch could not be committed is `hold()`-en by the
daemon and announced from memory, and the batch commit that finally records it records the
message as already sent. Both are exactly-once while the process lives; what was told from
memory is also written to the runtime directory (supervisor.notify.told: another file system,
kept across the daemon's restarts), so a daemon restarted during the outage reads the batch
again but records its crashes as told instead of telling them twice.

Transient crashes of one unit+signature are grouped: the first is announced at once, later ones
are folded into one message per `group_interval_s` that carries their count (Alertmanager's
group_wait=0 / group_interval). Delivery is paced to one message per `min_interval_s`, retried
with capped exponential backoff and jitter, honours Slack's Retry-After, and gives up after
`max_attempts` (Alertmanager's RetryStage, with a cap on attempts as well as time).

Backoff holds the *endpoint*, not the message: after a failure nothing is sent until the
backoff ends, and then the oldest due message goes first, so messages arrive in order after an
outage. Failures that prove the request never reached Slack (connection refused, TLS) do not
count against `max_attempts`: a message waits out an outage of any length. A timeout after the
request was sent is ambiguous (Slack may have posted it): it counts as an attempt, the retry may
duplicate the message (a webhook has no idempotency key), and the next attempt waits twice as
long (up to 4 x `timeout_s`), so a slow Slack costs at most a duplicate or two per message,
never a loss.

No poison message: an error that can never succeed (a URL httpx cannot use, a 4xx other than
429, a payload that cannot be rendered) drops the message at once, with one log line and
`notifications_dropped_total`; an exception nobody foresaw counts as an attempt. A webhook URL
that is unusable from the start turns Slack off (one error line, unhealthy on /healthz) while
pending messages wait for a fixed URL: the daemon itself never stops for Slack.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from ..errors import NotifyError, StateError
from ..model import Outcome
from ..state.tables import History
from ..store import Store, Writer
from ..telemetry.http import SinkState
from ..telemetry.metrics import Metrics
from ..util.aio import first_of
from ..util.jsontext import loads
from ..util.retry import Backoff
from .decision import (
    NotifyReason,
    dedupe_key,
    group_key,
    is_backlog,
    telling,
)
from .queue import MemberKey, OutboxQueue, QueuedMessage, dump
from .sink import Crash, EdgeSink, LevelSink, Result, failed
from .told import ToldLedger

BACKOFF_BASE_S = 1.0
RETENTION_S = 7 * 86400.0  # delivered and failed messages are kept this long for inspection
STATE_RETRY_S = 5.0  # wait after a state database error before trying again
MAX_TIMEOUT_GROWTH = 4  # an attempt after ambiguous timeouts waits up to 4 x timeout_s
MAX_HEALTHY_DEPTH = 100
MAX_CONSECUTIVE_FAILURES = 3
UNRENDERABLE = "unrenderable"
PERMANENT_REASONS = frozenset({"invalid_url", UNRENDERABLE})  # else a permanent one is a 4xx

Sleep = Callable[[float], Awaitable[Any]]

_log = structlog.get_logger()


@dataclass(slots=True, kw_only=True)
class _Held:
    """A message for a crash the database could not record yet; `sent_at` once delivered."""

    payload: str
    sent_at: float | None = None


def _noop(db: sqlite3.Connection) -> None:
    """A writer with nothing to queue."""


class Outbox:
    """Queues one sink's crash messages atomically with their batch and delivers them."""

    def __init__(
        self,
        store: Store,
        sink: EdgeSink,
        metrics: Metrics,
        *,
        host: str,
        now: Callable[[], float] = time.time,
        sleep: Sleep = asyncio.sleep,
        rng: random.Random | None = None,
        told: ToldLedger | None = None,
        fleet_tells: bool = False,
    ) -> None:
        self._store = store
        # Halts the fleet shares are told by its Alertmanager's group (supervisor.fleet).
        self._fleet_tells = fleet_tells
        self.sink = sink
        self._name = sink.name
        self._metrics = metrics
        self._config = sink.pacing
        self._host = host
        self._now = now
        self._sleep = sleep
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not cryptography
        self._wake = asyncio.Event()
        self._inflight: int | None = None
        self._next_send_at = 0.0
        self._last_error: str | None = None
        self._consecutive_failures = 0
        self._held: dict[MemberKey, _Held] = {}  # crashes not in the database yet, oldest first
        self._unrecorded: dict[int, float] = {}  # message id -> when Slack took it, not recorded
        # What an earlier daemon told from memory (supervisor.notify.told): never told again.
        self._told = told
        if told is not None:
            held, self._unrecorded = told.load()
            self._held = {m: _Held(payload="", sent_at=at) for m, at in held.items()}
        self._state_error: str | None = None  # the last write error, logged once
        self._queue = OutboxQueue(store, self._name)
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop `run` wakes on
        metrics.sink(self._name)

    async def _resume_interrupted(self) -> None:
        """Messages the previous run was sending when it ended go out again, marked."""
        with contextlib.suppress(StateError):
            if repeats := await self._queue.interrupted(self.sink.resent):
                _log.warning(
                    f"{self._name}_sending_interrupted",
                    count=repeats,
                    action="sent again, marked as a possible repeat",
                )

    # -- queueing (inside the batch transaction) ----------------------------------------------

    def writer_for(self, outcome: Outcome) -> Writer:
        """A writer for `Store.commit_batch(extra=[...])` that queues this crash's message."""
        reason = self._telling(outcome)
        if reason is NotifyReason.MUTED:
            self._metrics.notification("dropped", self._name)
        if reason in (NotifyReason.FOLDED, NotifyReason.PACED, NotifyReason.FLEET):
            self._metrics.notification("folded", self._name)
            inv = outcome.invocation

            def folded(db: sqlite3.Connection) -> None:
                # Told by the message of the halt that stands (or of the pacing that began, or
                # the fleet's group in Alertmanager): the story's one message.
                History(db).mark_notified([(inv.unit, inv.invocation_id)])

            return folded
        if not reason.tells:
            return _noop

        def write(db: sqlite3.Connection) -> None:
            self._add(db, outcome)

        return write

    def _telling(self, outcome: Outcome) -> NotifyReason:
        return telling(
            outcome,
            # Off or unusable: new crashes are not queued (those queued before wait for a fix).
            endpoint=self.sink.state().state == "on",
            notify_transient=self._config.notify_transient,
            fleet_tells=self._fleet_tells,
        )

    def _add(self, db: sqlite3.Connection, outcome: Outcome) -> None:
        """Add the crash to a new or an open group message; ignore a replay."""
        now, key = self._now(), dedupe_key(outcome)
        held = self._held.get((outcome.invocation.unit or "", key)) if key else None
        group = group_key(outcome)
        # The first message about crashes read late waits a little, so a backlog read at start-up
        # (30 crashes while the supervisor was down) becomes one summary message, not 30.
        added = self._queue.table(db).add(
            outcome,
            now=now,
            due=now + (self._config.backlog_hold_s if is_backlog(group) else 0.0),
            group_interval_s=self._config.group_interval_s,
            inflight=self._inflight,
            render=lambda grouped: self.sink.render(
                Crash(outcome=outcome, host=self._host, group=grouped)
            ),
            # Announced from memory while the database was full: record it as sent, once.
            sent_at=held.sent_at if held is not None else None,
        )
        if added is None:
            return  # this invocation is already queued: a replayed batch
        self._metrics.notification(added, self._name)
        # This runs in the state writer's thread, inside the batch's transaction: the run loop
        # is woken on its own loop once the row is committed (never after a rollback).
        self._store.after_commit(self._wake_from_writer)

    def _wake_from_writer(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake.set)

    # -- inspection -------------------------------------------------------------------------

    def wake(self) -> None:
        """Look at the queue now (e.g. after a commit that queued a message)."""
        self._wake.set()

    def hold(self, outcome: Outcome) -> None:
        """Announce a crash whose batch could not be committed, from memory, once.

        Grouped crashes (transient, read late) are left to the database (they are the least
        urgent); everything else goes out now instead of waiting for the disk to be fixed.
        """
        key = dedupe_key(outcome)
        if key is None or self._telling(outcome) is not NotifyReason.ALONE:
            return
        member = (outcome.invocation.unit or "", key)
        if member not in self._held:
            payload = self.sink.render(Crash(outcome=outcome, host=self._host))
            self._held[member] = _Held(payload=dump(payload))
            self._wake.set()

    def depth(self) -> int:
        """Messages waiting for delivery."""
        return self._queue.depth()

    def reset(self) -> None:
        """The sink's endpoint changed (a reload read a new URL): forget its failures and look
        at the queue now. Messages already queued go to the new one; crashes while it was off
        were not queued."""
        self._last_error, self._consecutive_failures, self._next_send_at = None, 0, 0.0
        self._wake.set()

    def state(self) -> SinkState:
        """The sink's own state; while on, the error of the last failed attempt."""
        state = self.sink.state()
        return SinkState("on", self._last_error) if state.state == "on" else state

    def health(self) -> tuple[bool, dict[str, Any]]:
        """For /healthz: unhealthy on a backlog, repeated failures or a stuck queue."""
        state = self.sink.state()
        if state.state == "off":
            return True, {self._name: "off", "reasons": []}
        if state.state != "on":
            return False, {self._name: state.state, "reasons": [state.last_error or state.state]}
        try:
            depth, overdue = self._queue.backlog(self._now())
        except StateError as exc:
            return False, {"outbox_depth": None, "reasons": [f"outbox unreadable: {exc}"]}
        reasons = []
        if depth > MAX_HEALTHY_DEPTH:
            reasons.append(f"outbox backlog: {depth} messages")
        if self._consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
            reasons.append(f"{self._name} failing: {self._last_error}")
        if overdue is not None and overdue > self._config.backoff_max_s + 60:
            reasons.append(f"outbox stuck: oldest message {overdue:.0f}s overdue")
        return not reasons, {"outbox_depth": depth, "reasons": reasons}

    # -- delivery ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Deliver pending messages until `stop` is set; state errors are logged and retried.
        Without a usable endpoint it waits for one (`reset`, at a reload)."""
        self._loop = asyncio.get_running_loop()
        await self._resume_interrupted()
        pruned = False
        while not stop.is_set():
            self._wake.clear()
            if self.sink.state().state != "on":
                await first_of(stop.wait(), self._wake.wait())
                continue
            try:
                if not pruned:
                    await self._queue.prune(self._now() - RETENTION_S)
                    pruned = True
                await self._step(stop)
            except StateError as exc:
                self._state_failed(exc)
                await self._wait(stop, STATE_RETRY_S)

    async def _step(self, stop: asyncio.Event) -> None:
        """Deliver the next due message, or wait until one is due or new work arrives."""
        await self._settle_memory()
        message = self._queue.next_due(list(self._unrecorded))
        held = next((k for k, h in self._held.items() if h.sent_at is None), None)
        self._metrics.outbox_depth(self.depth() + len(self._held), self._name)
        now = self._now()
        if message is None and held is None:
            await self._wait(stop, None)
            return
        # Held crashes are newer than anything in the database: they go after due messages.
        due = message.due if message is not None and (held is None or message.due <= now) else now
        wait_s = max(due, self._next_send_at) - now
        if wait_s > 0:
            await self._wait(stop, wait_s)
        elif message is not None and message.due <= now:
            await self._deliver(message)
        elif held is not None:
            await self._deliver_held(held)

    async def _wait(self, stop: asyncio.Event, seconds: float | None) -> None:
        """Until `stop`, `wake()` or `seconds` (the injected sleep), whichever comes first."""
        waits: list[Awaitable[object]] = [stop.wait(), self._wake.wait()]
        if seconds is not None:
            waits.append(self._sleep(seconds))
        await first_of(*waits)

    async def _attempt(self, payload: str, attempts: int) -> Result:
        """One send of a stored payload, however the sink fails, as a `Result`."""
        timeout_s = self._config.timeout_s * min(MAX_TIMEOUT_GROWTH, 2 ** min(attempts, 8))
        try:
            body = loads(payload)
        except ValueError:
            error = NotifyError(
                f"{self._name}: stored message is not JSON", reason=UNRENDERABLE, retryable=False
            )
            return failed(error)
        return await guarded_send(self.sink, body, timeout_s)

    async def _deliver(self, message: QueuedMessage) -> None:
        self._inflight = message.id
        # Recorded before the POST: a kill between Slack's 200 and recording it would repeat
        # the message after the restart, and the repeat then says so (queue.interrupted).
        with contextlib.suppress(StateError):
            await self._queue.sending(message.id)
        try:
            error = await self._attempt(message.payload, message.attempts)
        finally:
            self._inflight = None
        if error.delivered:
            await self._delivered(message)
        else:
            await self._failed(message, error)

    async def _deliver_held(self, member: MemberKey) -> None:
        """Send a held crash; if its batch was committed meanwhile, settle it in the database."""
        error = await self._attempt(self._held[member].payload, 0)
        message = self._queue.of_member(member)
        if message is not None:
            del self._held[member]
            if error.delivered:
                await self._delivered(message)
            else:
                await self._failed(message, error)
            return
        if error.delivered:
            self._held[member].sent_at = self._now()
            self._remember()
            self._sent_ok()
        elif not error.recoverable:
            del self._held[member]  # the database copy, once committed, gets its own attempts
            self._failed_endpoint(error, dropped=False)
        else:
            self._failed_endpoint(error, dropped=False)

    async def _settle_memory(self) -> None:
        """Record deliveries the database missed; forget held crashes it now has."""
        for message_id, sent_at in list(self._unrecorded.items()):
            try:
                await self._queue.record_sent(message_id, sent_at)
            except StateError:
                return
            del self._unrecorded[message_id]
            self._state_recovered()
            self._remember()
        recorded = [m for m, h in self._held.items() if self._queue.of_member(m) is not None]
        for member in recorded:
            del self._held[member]
        if recorded:
            self._remember()

    def _remember(self) -> None:
        """Keep what was told and is not in the database yet where a restart finds it."""
        if self._told is not None:
            told = {m: h.sent_at for m, h in self._held.items() if h.sent_at is not None}
            self._told.save(told, self._unrecorded)

    async def _delivered(self, message: QueuedMessage) -> None:
        """Mark the message sent and its crashes notified; keep that in memory if it fails."""
        now = self._now()
        try:
            await self._queue.record_sent(message.id, now)
        except StateError as exc:
            # The far end has it: never send it again, record it when the database takes writes.
            self._unrecorded[message.id] = now
            self._remember()
            self._state_failed(exc)
        else:
            self._state_recovered()
        self._sent_ok(message.attempts)

    def _sent_ok(self, attempts: int = 0) -> None:
        self._next_send_at = self._now() + self._config.min_interval_s
        self._metrics.notification("sent", self._name)
        if self._last_error is not None:
            _log.info(f"{self._name}_delivery_recovered", attempts=attempts + 1)
        self._last_error, self._consecutive_failures = None, 0

    def _state_failed(self, exc: StateError) -> None:
        self._metrics.state_error("write")
        if self._state_error is None:
            _log.error("outbox_state_error", error=str(exc), action="kept in memory")
        self._state_error = str(exc)

    def _state_recovered(self) -> None:
        if self._state_error is not None:
            _log.info("outbox_state_recovered")
        self._state_error = None

    async def _failed(self, message: QueuedMessage, result: Result) -> None:
        """Back the endpoint off, or give the message up when permanent or out of attempts."""
        attempts = message.attempts + (1 if result.reached else 0)
        if result.recoverable and attempts < self._config.max_attempts:
            await self._queue.update(message.id, attempts, "pending", message.due, result.reason)
            self._failed_endpoint(result, dropped=False, attempt=attempts)
        else:
            await self._queue.update(message.id, attempts, "failed", message.due, result.reason)
            self._metrics.notification_dropped(self._name, drop_reason(result))
            self._failed_endpoint(result, dropped=True, attempt=attempts)

    def _failed_endpoint(self, result: Result, *, dropped: bool, attempt: int = 1) -> None:
        """Pause all sending for a backoff; log a new error once."""
        now = self._now()
        self._consecutive_failures += 1
        delay = self._backoff(self._consecutive_failures, result) if result.recoverable else 0.0
        self._next_send_at = now + max(self._config.min_interval_s, delay)
        if dropped:
            self._metrics.notification("failed", self._name)
            _log.error(
                f"{self._name}_message_dropped",
                error=result.error,
                reason=result.reason,
                attempts=attempt,
            )
        else:
            self._metrics.notification("retried", self._name)
            if result.error != self._last_error:
                _log.warning(
                    f"{self._name}_delivery_failed",
                    error=result.error,
                    attempt=attempt,
                    retry_in_s=delay,
                )
        self._last_error = result.error

    def _backoff(self, attempts: int, result: Result) -> float:
        """Capped exponential backoff with jitter; at least the far end's Retry-After."""
        cap = max(BACKOFF_BASE_S, self._config.backoff_max_s)
        delay = Backoff(BACKOFF_BASE_S, cap, jitter=True).delay(attempts, self._rng)
        if result.retry_after is not None:
            delay = max(delay, min(cap, result.retry_after))
        return delay


async def guarded_send(sink: EdgeSink | LevelSink, payload: Any, timeout_s: float) -> Result:
    """`sink.send` bounded in time, with whatever it raises after all made a `Result`: a sink
    can never stop the loop that drives it (its text is not kept: it may hold the URL)."""
    try:
        async with asyncio.timeout(timeout_s + 5):
            return await sink.send(payload, timeout_s=timeout_s)
    except TimeoutError:
        error = NotifyError(f"{sink.name}: timeout: no answer", reason="timeout", retryable=True)
    except Exception as exc:  # never a crash loop
        error = NotifyError(
            f"{sink.name}: unexpected {type(exc).__name__}", reason="internal", retryable=True
        )
    return failed(error)


def drop_reason(result: Result) -> str:
    """The `reason` label of a dropped message (bounded; a far end's own codes are 4xx)."""
    if result.recoverable:
        return "attempts_exhausted"
    return result.reason if result.reason in PERMANENT_REASONS else "http_4xx"
