"""The durable outbox's delivery loop: pacing, retries, holding through a disk outage, health.

Whether a crash is told is `notify.decision`'s; the tables are `notify.queue`'s; this module times
and sends. Queueing is a `Writer` that runs inside the batch's transaction (`Store.commit_batch`),
so a message exists exactly when the crash it reports is recorded. `Outbox.run` delivers pending
messages, marks the crashes `notified` in the history in the same transaction that marks the
message sent, and survives supervisor restarts: each crash is announced once. (Only a crash of the
supervisor between Slack's 200 and that commit can repeat a message: at-least-once at the wire,
exactly-once in the database; the message is marked `sending` before its POST, so the repeat
says it may be one.)

While the database cannot be written (disk full), alerting goes on from memory: a 200 whose
"sent" cannot be recorded is kept in memory (that message is not sent again) and recorded once
the database takes writes; a crash whose batch could not be committed is `hold()`-en by the
daemon and announced from memory, and the batch commit that finally records it records the
message as already sent. Both are exactly-once while the process lives, and at-least-once
across a crash of the supervisor during the outage (the batch is then read again and its crash
announced again): the only alternative is at-most-once, silence until the disk is fixed.

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
import json
import random
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from ..config import SlackConfig, webhook_source
from ..errors import NotifyError, StateError
from ..model import Outcome
from ..store import Store, Writer, mark_notified
from ..telemetry.metrics import Metrics
from ..util.aio import first_of
from ..util.retry import Backoff
from .decision import (
    NotifyReason,
    dedupe_key,
    group_key,
    is_backlog,
    telling,
)
from .message import build_payload
from .queue import MemberKey, OutboxQueue, QueuedMessage, dump
from .webhook import SlackRateLimited, SlackWebhook

BACKOFF_BASE_S = 1.0
RETENTION_S = 7 * 86400.0  # delivered and failed messages are kept this long for inspection
STATE_RETRY_S = 5.0  # wait after a state database error before trying again
MAX_TIMEOUT_GROWTH = 4  # an attempt after ambiguous timeouts waits up to 4 x timeout_s
UNREACHABLE = frozenset({"connect", "tls"})  # the request never reached Slack
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
        self._held: dict[MemberKey, _Held] = {}  # crashes not in the database yet, oldest first
        self._unrecorded: dict[int, float] = {}  # message id -> when Slack took it, not recorded
        self._state_error: str | None = None  # the last write error, logged once
        self._queue = OutboxQueue(store)
        self._invalid = self._check_url(webhook)  # why Slack is off though configured
        with contextlib.suppress(StateError):
            if repeats := self._queue.interrupted():
                _log.warning(
                    "slack_sending_interrupted",
                    count=repeats,
                    action="sent again, marked as a possible repeat",
                )

    def _check_url(self, webhook: SlackWebhook | None) -> str | None:
        """One error line, naming where the URL came from (never the URL), when it is unusable."""
        if webhook is None or webhook.problem is None:
            return None
        source = webhook_source(self._config)
        _log.error(
            "slack_webhook_invalid",
            source=source,
            problem=webhook.problem,
            action="Slack is off: crashes are still halted and recorded, their messages wait; "
            "fix the URL (vllm-supervisor check-config) and reload",
        )
        return f"slack webhook URL from {source} unusable ({webhook.problem}): Slack is off"

    # -- queueing (inside the batch transaction) ----------------------------------------------

    def writer_for(self, outcome: Outcome) -> Writer:
        """A writer for `Store.commit_batch(extra=[...])` that queues this crash's message."""
        reason = self._telling(outcome)
        if reason is NotifyReason.MUTED:
            self._metrics.notification("dropped")
        if reason is NotifyReason.FOLDED:
            self._metrics.notification("folded")
            inv = outcome.invocation

            def folded(db: sqlite3.Connection) -> None:
                # Told by the message of the halt that stands: the story's one message.
                mark_notified(db, [(inv.unit, inv.invocation_id)])

            return folded
        if not reason.tells:
            return _noop

        def write(db: sqlite3.Connection) -> None:
            self._add(db, outcome)

        return write

    def _telling(self, outcome: Outcome) -> NotifyReason:
        return telling(
            outcome,
            endpoint=self._webhook is not None and self._invalid is None,
            notify_transient=self._config.notify_transient,
        )

    def _add(self, db: sqlite3.Connection, outcome: Outcome) -> None:
        """Add the crash to a new or an open group message; ignore a replay."""
        now, key = self._now(), dedupe_key(outcome)
        held = self._held.get((outcome.invocation.unit or "", key)) if key else None
        group = group_key(outcome)
        # The first message about crashes read late waits a little, so a backlog read at start-up
        # (30 crashes while the supervisor was down) becomes one summary message, not 30.
        added = self._queue.add(
            db,
            outcome,
            now=now,
            due=now + (self._config.backlog_hold_s if is_backlog(group) else 0.0),
            group_interval_s=self._config.group_interval_s,
            inflight=self._inflight,
            render=lambda grouped: build_payload(outcome, host=self._host, group=grouped),
            # Announced from memory while the database was full: record it as sent, once.
            sent_at=held.sent_at if held is not None else None,
        )
        if added is None:
            return  # this invocation is already queued: a replayed batch
        self._metrics.notification(added)
        # The run loop cannot see the row before this synchronous commit returns, so waking
        # it now is safe; after a rollback it simply finds nothing new.
        self._wake.set()

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
            payload = build_payload(outcome, host=self._host)
            self._held[member] = _Held(payload=dump(payload))
            self._wake.set()

    def depth(self) -> int:
        """Messages waiting for delivery."""
        return self._queue.depth()

    def use(self, webhook: SlackWebhook | None) -> None:
        """Deliver to `webhook` from now on (a reload read a new URL); None turns Slack off.
        Messages already queued go to the new one; crashes while off were not queued."""
        self._webhook = webhook
        self._invalid = self._check_url(webhook)
        self._last_error, self._consecutive_failures, self._next_send_at = None, 0, 0.0
        self._wake.set()

    @property
    def last_error(self) -> str | None:
        """Why the last attempt failed (no URL in it); None once one succeeds."""
        return self._last_error

    def health(self) -> tuple[bool, dict[str, Any]]:
        """For /healthz: unhealthy on a backlog, repeated failures or a stuck queue."""
        if self._webhook is None:
            return True, {"slack": "off", "reasons": []}
        if self._invalid is not None:
            return False, {"slack": "invalid_url", "reasons": [self._invalid]}
        try:
            depth, overdue = self._queue.backlog(self._now())
        except StateError as exc:
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
        """Deliver pending messages until `stop` is set; state errors are logged and retried.
        Without a usable webhook it waits for one (`use`, at a reload)."""
        pruned = False
        while not stop.is_set():
            self._wake.clear()
            if self._webhook is None or self._invalid is not None:
                await first_of(stop.wait(), self._wake.wait())
                continue
            try:
                if not pruned:
                    self._queue.prune(self._now() - RETENTION_S)
                    pruned = True
                await self._step(stop)
            except StateError as exc:
                self._state_failed(exc)
                await self._wait(stop, STATE_RETRY_S)

    async def _step(self, stop: asyncio.Event) -> None:
        """Deliver the next due message, or wait until one is due or new work arrives."""
        self._settle_memory()
        message = self._queue.next_due(list(self._unrecorded))
        held = next((k for k, h in self._held.items() if h.sent_at is None), None)
        self._metrics.outbox_depth(self.depth() + len(self._held))
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

    async def _attempt(self, payload: str, attempts: int) -> NotifyError | None:
        """One POST; the error, or None when Slack took it."""
        assert self._webhook is not None  # noqa: S101 - run() returns early without one
        timeout_s = self._config.timeout_s * min(MAX_TIMEOUT_GROWTH, 2**attempts)
        try:
            body = json.loads(payload)
        except ValueError:
            return NotifyError(
                "slack: stored message is not JSON", reason=UNRENDERABLE, retryable=False
            )
        try:
            async with asyncio.timeout(timeout_s + 5):
                await self._webhook.send(body, timeout_s=timeout_s)
        except NotifyError as exc:
            return exc
        except TimeoutError:
            return NotifyError("slack: timeout: no answer", reason="timeout", retryable=True)
        except Exception as exc:  # never a crash loop; its text may hold the URL
            name = type(exc).__name__
            return NotifyError(f"slack: unexpected {name}", reason="internal", retryable=True)
        return None

    async def _deliver(self, message: QueuedMessage) -> None:
        self._inflight = message.id
        # Recorded before the POST: a kill between Slack's 200 and recording it would repeat
        # the message after the restart, and the repeat then says so (queue.interrupted).
        with contextlib.suppress(StateError):
            self._queue.sending(message.id)
        try:
            error = await self._attempt(message.payload, message.attempts)
        finally:
            self._inflight = None
        if error is None:
            self._delivered(message)
        else:
            self._failed(message, error)

    async def _deliver_held(self, member: MemberKey) -> None:
        """Send a held crash; if its batch was committed meanwhile, settle it in the database."""
        error = await self._attempt(self._held[member].payload, 0)
        message = self._queue.of_member(member)
        if message is not None:
            del self._held[member]
            if error is None:
                self._delivered(message)
            else:
                self._failed(message, error)
            return
        if error is None:
            self._held[member].sent_at = self._now()
            self._sent_ok()
        elif not error.retryable:
            del self._held[member]  # the database copy, once committed, gets its own attempts
            self._failed_endpoint(error, dropped=False)
        else:
            self._failed_endpoint(error, dropped=False)

    def _settle_memory(self) -> None:
        """Record deliveries the database missed; forget held crashes it now has."""
        for message_id, sent_at in list(self._unrecorded.items()):
            try:
                self._queue.record_sent(message_id, sent_at)
            except StateError:
                return
            del self._unrecorded[message_id]
            self._state_recovered()
        for member in [m for m, h in self._held.items() if self._queue.of_member(m) is not None]:
            del self._held[member]

    def _delivered(self, message: QueuedMessage) -> None:
        """Mark the message sent and its crashes notified; keep that in memory if it fails."""
        now = self._now()
        try:
            self._queue.record_sent(message.id, now)
        except StateError as exc:
            # Slack has it: never send it again, record it when the database takes writes.
            self._unrecorded[message.id] = now
            self._state_failed(exc)
        else:
            self._state_recovered()
        self._sent_ok(message.attempts)

    def _sent_ok(self, attempts: int = 0) -> None:
        self._next_send_at = self._now() + self._config.min_interval_s
        self._metrics.notification("sent")
        if self._last_error is not None:
            _log.info("slack_delivery_recovered", attempts=attempts + 1)
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

    def _failed(self, message: QueuedMessage, exc: NotifyError) -> None:
        """Back the endpoint off, or give the message up when permanent or out of attempts."""
        attempts = message.attempts + (0 if exc.reason in UNREACHABLE else 1)
        if exc.retryable and attempts < self._config.max_attempts:
            self._queue.update(message.id, attempts, "pending", message.due, exc.reason)
            self._failed_endpoint(exc, dropped=False, attempt=attempts)
        else:
            self._queue.update(message.id, attempts, "failed", message.due, exc.reason)
            self._metrics.notification_dropped("slack", _drop_reason(exc))
            self._failed_endpoint(exc, dropped=True, attempt=attempts)

    def _failed_endpoint(self, exc: NotifyError, *, dropped: bool, attempt: int = 1) -> None:
        """Pause all sending for a backoff; log a new error once."""
        now = self._now()
        self._consecutive_failures += 1
        delay = self._backoff(self._consecutive_failures, exc) if exc.retryable else 0.0
        self._next_send_at = now + max(self._config.min_interval_s, delay)
        if dropped:
            self._metrics.notification("failed")
            _log.error("slack_message_dropped", error=str(exc), reason=exc.reason, attempts=attempt)
        else:
            self._metrics.notification("retried")
            if str(exc) != self._last_error:
                _log.warning(
                    "slack_delivery_failed", error=str(exc), attempt=attempt, retry_in_s=delay
                )
        self._last_error = str(exc)

    def _backoff(self, attempts: int, exc: NotifyError) -> float:
        """Capped exponential backoff with jitter; at least Slack's Retry-After."""
        cap = max(BACKOFF_BASE_S, self._config.backoff_max_s)
        delay = Backoff(BACKOFF_BASE_S, cap, jitter=True).delay(attempts, self._rng)
        if isinstance(exc, SlackRateLimited) and exc.retry_after is not None:
            delay = max(delay, min(cap, exc.retry_after))
        return delay


def _drop_reason(exc: NotifyError) -> str:
    """The `reason` label of a dropped message (bounded; Slack's own codes are 4xx)."""
    if exc.retryable:
        return "attempts_exhausted"
    return exc.reason if exc.reason in PERMANENT_REASONS else "http_4xx"
