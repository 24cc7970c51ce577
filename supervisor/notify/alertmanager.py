"""Prometheus Alertmanager as a sink: a halted unit is a firing alert until it is released.

Alertmanager shops route every page through one tree (silences, inhibition, PagerDuty and
Opsgenie receivers); a halt belongs there as an alert, not only as a Slack message. The sink
is level-triggered, as Prometheus's own notifier is: what should fire is read from the
quarantine records themselves (the durable truth of what is halted, which the gate reads too),
and every `resend_s` the firing alerts are posted again with `endsAt` four intervals ahead, so
an Alertmanager that restarted empty, or was down, has them again at the next round; a unit
no longer quarantined is posted once more as resolved (`endsAt` now). Which alerts were
sent firing is kept in the state database, so a release while the daemon was down is still
resolved after its restart. A failed post is retried by the shared rule (util.retry), capped at
`backoff_max_s`, and logged once per outage; the URL's credentials, if any, never reach a log.
What can never succeed is not retried into a loop: a URL httpx cannot use stops the sink (one
error line), a 4xx or alerts that cannot be encoded drop that round until the next `resend_s`;
each is counted in `notifications_dropped_total{sink="alertmanager"}`.

The alert is the shipped Prometheus rule's, label for label (alertname, host, unit, severity;
deploy/prometheus/alerts.yml), so where both are configured Alertmanager deduplicates them into
one alert and one notification per halt. Labels are only what the rule can know too: the crash's
signature and its own severity travel as annotations, and `severity` is the routing one
(`critical`: a unit is down).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import structlog

from ..config import AlertmanagerConfig
from ..errors import NotifyError, StateError
from ..store import Store
from ..telemetry.http import SinkState
from ..telemetry.metrics import Metrics
from ..util.aio import first_of
from ..util.retry import Backoff
from ..util.urls import redact, url_problem
from .webhook import (
    MAX_BODY_BYTES,
    bounded,
    encode_json,
    one_line,
    read_bounded,
    unexpected_error,
)

ALERT_NAME = "VllmSupervisorUnitHalted"
SEVERITY = "critical"  # a halted unit serves nothing until someone acts: it pages
# The README section that says what a halt is and what to do (the rule's runbook_url too).
RUNBOOK_URL = (
    "https://github.com/vllm-supervisor/vllm-supervisor/blob/main/README.md"
    "#vllmsupervisorunithalted"
)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS alert_firing (
    unit TEXT PRIMARY KEY,
    labels TEXT NOT NULL          -- the JSON labels it was sent with, to resolve it by them
);
"""
if TYPE_CHECKING:
    import httpx

_RETRY_BASE_S = 1.0

log = structlog.get_logger(__name__)

Quarantined = Callable[[], Mapping[str, Mapping[str, Any]]]


def alert(unit: str, record: Mapping[str, Any], *, host: str) -> dict[str, Any]:
    """The firing alert of a unit's quarantine record: the labels the shipped rule gives the
    same halt (bounded, no free text); what only the record knows goes in annotations."""
    labels = {"alertname": ALERT_NAME, "host": host, "unit": unit, "severity": SEVERITY}
    annotations = {
        "summary": f"{unit} on {host} is halted: {record.get('title') or 'a fatal crash'}",
        "signature": str(record.get("signature") or "unknown"),
        "crash_severity": str(record.get("severity") or "unknown"),
        "root_cause": str(record.get("root_cause") or "no root-cause line found"),
        "remediation": str(record.get("remediation") or ""),
        "release": f"vllm-supervisor release {unit}",
        "invocation_id": str(record.get("invocation_id") or ""),
        "halted_since": str(record.get("time") or ""),
        "runbook_url": RUNBOOK_URL,
    }
    return {"labels": labels, "annotations": {k: v for k, v in annotations.items() if v}}


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


class AlertmanagerSink:
    """Keeps Alertmanager's view of halted units in step with the quarantine records."""

    def __init__(
        self,
        config: AlertmanagerConfig,
        store: Store,
        quarantined: Quarantined,
        *,
        host: str,
        clock: Callable[[], float] = time.time,
        transport: httpx.AsyncBaseTransport | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        if config.url is None:
            raise ValueError("an Alertmanager sink needs alertmanager.url")
        self._config = config
        self._url = config.url
        self._problem = url_problem(config.url)  # why it can never be posted to
        self._metrics = metrics
        self._endpoint = config.url.rstrip("/") + "/api/v2/alerts"
        self._store = store
        self._quarantined = quarantined
        self._host = host
        self._clock = clock
        self._transport = transport
        self._wake = asyncio.Event()
        self._failing: str | None = None  # the error of the current outage, logged once
        try:
            store.connection.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise StateError(f"{store.path}: cannot create the alert table: {exc}") from exc

    def wake(self) -> None:
        """Look at the quarantine records now (a halt or a release happened)."""
        self._wake.set()

    def state(self) -> SinkState:
        """For /healthz: on, or invalid_url; the error of the current outage (redacted)."""
        if self._problem is not None:
            return SinkState("invalid_url", f"alertmanager.url unusable: {self._problem}")
        return SinkState("on", self._failing)

    async def run(self, stop: asyncio.Event) -> None:
        """Post the firing and resolved alerts every `resend_s`, at once when woken."""
        import httpx  # where it is used (see notify.webhook on why)

        if self._problem is not None:
            self._unusable(self._problem)
            await stop.wait()
            return
        retry = Backoff(_RETRY_BASE_S, max(_RETRY_BASE_S, self._config.backoff_max_s))
        failures = 0
        async with httpx.AsyncClient(
            timeout=self._config.timeout_s, trust_env=False, transport=self._transport
        ) as client:
            while not stop.is_set() and self._problem is None:
                self._wake.clear()
                ok = await self.reconcile(client)
                failures = 0 if ok else failures + 1
                wait = self._config.resend_s if ok else retry.delay(failures)
                await first_of(stop.wait(), self._wake.wait(), at_most_s=wait)
        if self._problem is not None:
            await stop.wait()  # unusable after all (httpx refused it): the daemon goes on

    async def reconcile(self, client: httpx.AsyncClient) -> bool:
        """One round: post what fires and what stopped firing. True: wait `resend_s` (taken,
        or dropped for good); False: retry after a backoff."""
        now = self._clock()
        try:
            firing = {u: alert(u, r, host=self._host) for u, r in self._quarantined().items()}
            sent = self._sent()
        except (OSError, StateError) as exc:
            return self._failed(f"cannot read what is halted: {exc}")
        ends = _iso(now + 4 * self._config.resend_s)
        body = [
            {**a, "startsAt": a["annotations"].get("halted_since") or _iso(now), "endsAt": ends}
            for a in firing.values()
        ]
        body += [
            {"labels": labels, "startsAt": _iso(now - 1), "endsAt": _iso(now)}
            for unit, labels in sent.items()
            if unit not in firing or firing[unit]["labels"] != labels
        ]
        if not body:
            return True
        try:
            content = encode_json(body, "alertmanager")
        except NotifyError as exc:
            return self._dropped("unrenderable", str(exc))
        error = await self._post(client, content)
        if error is not None:
            if error.retryable:
                return self._failed(error.args[0])
            return self._dropped(error.reason, error.args[0])
        try:
            self._remember({u: a["labels"] for u, a in firing.items()})
        except StateError as exc:
            return self._failed(str(exc))
        if self._failing is not None:
            log.info("alertmanager_recovered")
            self._failing = None
        return True

    async def _post(self, client: httpx.AsyncClient, content: bytes) -> NotifyError | None:
        """One POST; None when Alertmanager took it, else a classified, redacted error."""
        import httpx

        headers = {"Content-Type": "application/json"}
        try:
            async with client.stream("POST", self._endpoint, content=content, headers=headers) as r:
                if r.is_success:
                    return None
                text = bounded(
                    self._redact(
                        one_line((await read_bounded(r, MAX_BODY_BYTES)).decode("utf-8", "replace"))
                    )
                )
        except httpx.HTTPError as exc:
            detail = self._redact(f"{type(exc).__name__}: {exc}")
            return NotifyError(detail, reason="transport", retryable=True)
        except Exception as exc:  # a URL httpx cannot use, or the unforeseen
            return unexpected_error(exc, "alertmanager")
        retryable = r.status_code >= 500 or r.status_code == 429
        reason = "http_5xx" if r.status_code >= 500 else "http_4xx"
        return NotifyError(f"HTTP {r.status_code}: {text}", reason=reason, retryable=retryable)

    def _redact(self, text: str) -> str:
        return redact(text, self._url)

    def _dropped(self, reason: str, error: str) -> bool:
        """A round that can never succeed as it is: counted, logged once, not retried soon."""
        if reason == "invalid_url":
            self._problem = error
            self._unusable(error)
            return False
        if self._metrics is not None:
            self._metrics.notification_dropped("alertmanager", reason)
        if error != self._failing:
            log.error(
                "alertmanager_alerts_dropped",
                reason=reason,
                error=error,
                action=f"not retried; tried again in {self._config.resend_s:.0f}s",
            )
        self._failing = error
        return True

    def _unusable(self, problem: str) -> None:
        if self._metrics is not None:
            self._metrics.notification_dropped("alertmanager", "invalid_url")
        log.error(
            "alertmanager_url_invalid",
            problem=problem,
            action="Alertmanager is off (halts still happen); fix alertmanager.url and restart",
        )

    def _failed(self, error: str) -> bool:
        if error != self._failing:
            log.warning(
                "alertmanager_unreachable",
                error=error,
                action="retrying; halted units stay halted, alerts follow once it answers",
            )
        self._failing = error
        return False

    def _sent(self) -> dict[str, dict[str, str]]:
        try:
            with self._store.lock:
                rows = self._store.connection.execute(
                    "SELECT unit, labels FROM alert_firing"
                ).fetchall()
        except sqlite3.Error as exc:
            raise StateError(f"{self._store.path}: cannot read the alert table: {exc}") from exc
        return {str(unit): json.loads(labels) for unit, labels in rows}

    def _remember(self, firing: Mapping[str, Mapping[str, str]]) -> None:
        with self._store.transaction() as db:
            db.execute("DELETE FROM alert_firing")
            db.executemany(
                "INSERT INTO alert_firing (unit, labels) VALUES (?, ?)",
                [
                    (unit, json.dumps(dict(labels), sort_keys=True))
                    for unit, labels in firing.items()
                ],
            )
