"""The delivery loop of one level-triggered sink: a halted unit is an open incident until it is
released.

What is open is read from the quarantine records themselves (the durable truth of what is
halted, which the gate reads too), not from crashes as they pass; every `resend_s` (and at once
when woken by a halt or a release) the sink renders the round's `Incidents` and sends them, so
a far end that restarted empty, or was down, has them again at the next round. What the sink
last had delivered as open is kept per (sink, unit) in the `incident` table, so a release while
the daemon was down is still closed after its restart, by the identity it was opened with.

Failures are the shared rule's (util.retry backoff, capped at `backoff_max_s`), logged once per
outage (`<sink>_unreachable`); a round that can never succeed as it is (a 4xx, a body that cannot
be encoded) is dropped until the next `resend_s`, and a URL that cannot be used stops the sink
with one line (`<sink>_url_invalid`); each is counted in `notifications_dropped_total`. The
daemon itself never stops for a sink.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import structlog

from ..errors import StateError
from ..state.tables import json_objects_by_unit
from ..store import Store
from ..telemetry.http import SinkState
from ..telemetry.metrics import Metrics
from ..util.aio import first_of
from ..util.retry import Backoff
from .outbox import guarded_send
from .sink import Incidents, LevelSink, Result

_RETRY_BASE_S = 1.0

log = structlog.get_logger(__name__)

# What is halted now: unit -> its quarantine record (supervisor.actions.quarantine).
Quarantined = Callable[[], Mapping[str, Mapping[str, Any]]]


class LevelLoop:
    """Keeps one level sink's view of halted units in step with the quarantine records."""

    def __init__(
        self,
        sink: LevelSink,
        store: Store,
        quarantined: Quarantined,
        *,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sink = sink
        self._name = sink.name
        self._store = store
        store.register(IncidentTable)
        self._quarantined = quarantined
        self._metrics = metrics
        self._clock = clock
        self._wake = asyncio.Event()
        self._failing: str | None = None  # the error of the current outage, logged once
        self._unusable: str | None = None  # why it can never send (a URL httpx refused)
        if metrics is not None:
            metrics.sink(self._name)

    def wake(self) -> None:
        """Look at the quarantine records now (a halt or a release happened)."""
        self._wake.set()

    def state(self) -> SinkState:
        """For /healthz: on (with the current outage's error), or why it is not."""
        state = self.sink.state()
        if state.state != "on":
            return state
        if self._unusable is not None:
            return SinkState("invalid_url", self._unusable)
        return SinkState("on", self._failing)

    async def run(self, stop: asyncio.Event) -> None:
        """Send the open and closed incidents every `resend_s`, at once when woken."""
        pacing = self.sink.pacing
        retry = Backoff(_RETRY_BASE_S, max(_RETRY_BASE_S, pacing.backoff_max_s))
        failures = 0
        state = self.sink.state()
        if state.state == "invalid_url":
            self._stop(state.last_error or "unusable")
        while not stop.is_set() and self._unusable is None and state.state == "on":
            self._wake.clear()
            ok = await self.reconcile()
            failures = 0 if ok else failures + 1
            wait = pacing.resend_s if ok else retry.delay(failures)
            await first_of(stop.wait(), self._wake.wait(), at_most_s=wait)
        await stop.wait()  # off or unusable: the daemon goes on without this sink

    async def reconcile(self) -> bool:
        """One round. True: wait `resend_s` (taken, or dropped for good); False: retry after a
        backoff."""
        if self.sink.state().state != "on":
            return True  # off: nothing is said, the quarantine is not even read
        try:
            incidents = Incidents(open=self._quarantined(), sent=self._sent(), now=self._clock())
        except (OSError, StateError) as exc:
            return self._failed(f"cannot read what is halted: {exc}")
        round_ = self.sink.render(incidents)
        if round_ is None:
            return True
        result = await guarded_send(self.sink, round_, self.sink.pacing.timeout_s)
        if not result.delivered:
            return self._failed(result.error) if result.recoverable else self._dropped(result)
        try:
            await self._remember(round_.open)
        except StateError as exc:
            return self._failed(str(exc))
        if self._metrics is not None:
            self._metrics.notification("sent", self._name)
        if self._failing is not None:
            log.info(f"{self._name}_recovered")
            self._failing = None
        return True

    def _dropped(self, result: Result) -> bool:
        """A round that can never succeed as it is: counted, logged once, not retried soon."""
        if result.reason == "invalid_url":
            self._stop(result.error)
            return False
        if self._metrics is not None:
            self._metrics.notification_dropped(self._name, result.reason)
        if result.error != self._failing:
            log.error(
                f"{self._name}_alerts_dropped",
                reason=result.reason,
                error=result.error,
                action=f"not retried; tried again in {self.sink.pacing.resend_s:.0f}s",
            )
        self._failing = result.error
        return True

    def _stop(self, problem: str) -> None:
        self._unusable = problem
        if self._metrics is not None:
            self._metrics.notification_dropped(self._name, "invalid_url")
        log.error(
            f"{self._name}_url_invalid",
            problem=problem,
            action=f"{self._name} is off (halts still happen); fix its url and restart",
        )

    def _failed(self, error: str) -> bool:
        if error != self._failing:
            log.warning(
                f"{self._name}_unreachable",
                error=error,
                action="retrying; halted units stay halted, alerts follow once it answers",
            )
        if self._metrics is not None:
            self._metrics.notification("retried", self._name)
        self._failing = error
        return False

    def _sent(self) -> dict[str, Any]:
        return self._store.read(lambda db: IncidentTable(db, self._name).sent())

    async def _remember(self, open_: Mapping[str, Any]) -> None:
        await self._store.write(lambda db: IncidentTable(db, self._name).replace(open_))


class IncidentTable:
    """`incident`: the repository of what a level sink last had delivered as open, per unit."""

    TABLES: ClassVar[tuple[str, ...]] = ("incident",)

    def __init__(self, db: sqlite3.Connection, sink: str) -> None:
        self._db = db
        self.sink = sink

    def sent(self) -> dict[str, Any]:
        rows = self._db.execute("SELECT unit, identity FROM incident WHERE sink = ?", (self.sink,))
        # A unit left out is never resolved by this identity: Alertmanager ends it at endsAt.
        return json_objects_by_unit(rows, table="incident")

    def replace(self, open_: Mapping[str, Any]) -> None:
        self._db.execute("DELETE FROM incident WHERE sink = ?", (self.sink,))
        self._db.executemany(
            "INSERT INTO incident (sink, unit, identity) VALUES (?, ?, ?)",
            [
                (self.sink, unit, json.dumps(identity, sort_keys=True))
                for unit, identity in open_.items()
            ],
        )
