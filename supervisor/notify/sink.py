"""The contract every sink implements, after Alertmanager's `Notifier.Notify(ctx, alerts)
(recoverable, err)`: `render` a subject into a payload (pure), `send` the payload once and say
how it went (`Result`: delivered, a recoverable error, or a permanent one).

A sink comes in one of two modes of the same contract:

- **edge-triggered** (`Mode.EDGE`, Slack): one message per crash, exactly once. Its subject is
  a `Crash`; the outbox (supervisor.notify.outbox) queues the payload in the crash's own
  transaction and owns pacing, retries, backoff and giving up, the same for every such sink.
- **level-triggered** (`Mode.LEVEL`, Alertmanager): an open incident while a unit is halted.
  Its subject is the `Incidents` of one round (what is halted now, what was last sent open);
  the level loop (supervisor.notify.level) renders and sends them every `resend_s` and at
  every halt or release, with the same backoff.

What a sink does not do: time, retry, count or log its attempts. A sink never raises from
`send` and never puts its secret (a URL) in a `Result`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from ..errors import NotifyError
from ..model import Outcome
from ..telemetry.http import SinkState
from .decision import Group


class Mode(StrEnum):
    """How a sink tells: once per crash, or as long as a unit is halted."""

    EDGE = "edge"
    LEVEL = "level"


class Delivery(StrEnum):
    """How one `send` went (Alertmanager's Retrier.Check: 2xx, 5xx/429, anything else)."""

    DELIVERED = "delivered"
    RECOVERABLE = "recoverable"  # worth another attempt after a backoff
    PERMANENT = "permanent"  # can never succeed as it is: dropped, counted, logged once


# Reasons that prove the request never reached the far end: an attempt that cannot have
# delivered (and so cannot duplicate) a message is not counted against max_attempts.
UNREACHED = frozenset({"connect", "tls"})


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """What one `send` did. `reason` is a bounded metric label; `error` one redacted line."""

    delivery: Delivery
    reason: str = ""
    error: str = ""
    retry_after: float | None = None  # the far end's own wait (Slack's Retry-After), seconds

    @property
    def delivered(self) -> bool:
        """True when the far end took the payload."""
        return self.delivery is Delivery.DELIVERED

    @property
    def recoverable(self) -> bool:
        """True when another attempt may succeed."""
        return self.delivery is Delivery.RECOVERABLE

    @property
    def reached(self) -> bool:
        """False when the request provably never left (it cannot have been delivered)."""
        return self.reason not in UNREACHED


DELIVERED = Result(delivery=Delivery.DELIVERED)


def failed(exc: NotifyError, *, retry_after: float | None = None) -> Result:
    """The `Result` of a classified, redacted `NotifyError`."""
    delivery = Delivery.RECOVERABLE if exc.retryable else Delivery.PERMANENT
    return Result(delivery=delivery, reason=exc.reason, error=str(exc), retry_after=retry_after)


@dataclass(frozen=True, slots=True, kw_only=True)
class Pacing:
    """How a sink's deliveries are timed: the same knobs, and the same code, for every sink."""

    min_interval_s: float = 1.0  # between two messages
    timeout_s: float = 10.0  # one attempt (an edge sink's grows after ambiguous timeouts)
    max_attempts: int = 8  # an edge sink gives a message up after this many
    backoff_max_s: float = 300.0  # the longest wait after failures
    group_interval_s: float = 300.0  # transient crashes of one kind: one message per interval
    backlog_hold_s: float = 30.0  # crashes read late wait this long to become one summary
    notify_transient: bool = True  # transient crashes are told (grouped) at all
    resend_s: float = 60.0  # a level sink's open incidents are sent again this often


@dataclass(frozen=True, slots=True, kw_only=True)
class Crash:
    """An edge sink's subject: one crash (or a group of them), on this host."""

    outcome: Outcome
    host: str
    group: Group | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Incidents:
    """A level sink's subject for one round.

    `open` is what is halted now (unit -> its quarantine record); `sent` is what the sink last
    had delivered as open (unit -> the identity `Round.open` gave it), so a unit released
    meanwhile, even while the daemon was down, is closed by the identity it was opened with.
    """

    open: Mapping[str, Mapping[str, Any]]
    sent: Mapping[str, Any]
    now: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Round:
    """A level sink's payload: the body to send, and the identity of each unit it keeps open."""

    body: Any
    open: Mapping[str, Any] = field(default_factory=dict)


S_contra = TypeVar("S_contra", contravariant=True)
P = TypeVar("P")


class Sink(Protocol[S_contra, P]):
    """A place crashes are told. Edge sinks are `Sink[Crash, Any]`, level sinks
    `Sink[Incidents, Round | None]` (None: nothing to send this round)."""

    @property
    def name(self) -> str:
        """A short lowercase name: the `sink` label, log events (`<name>_...`), /healthz."""
        ...

    @property
    def mode(self) -> Mode: ...

    @property
    def pacing(self) -> Pacing: ...

    def state(self) -> SinkState:
        """On; off (nothing configured) or invalid_url (configured but unusable), with why:
        either way new crashes are not queued for it, and those queued before wait."""
        ...

    def render(self, subject: S_contra) -> P:
        """The payload for `subject`; pure, never raises."""
        ...

    def resent(self, payload: P) -> P:
        """`payload` as it goes out again after a restart cut its send short (it may have
        arrived once): marked so, or unchanged where the far end deduplicates by a key."""
        ...

    async def send(self, payload: P, *, timeout_s: float) -> Result:
        """One attempt, classified; never raises, never names the secret."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


EdgeSink = Sink[Crash, Any]
LevelSink = Sink[Incidents, "Round | None"]
