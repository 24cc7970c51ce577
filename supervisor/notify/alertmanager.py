"""Prometheus Alertmanager as a level-triggered sink: a halted unit is a firing alert until it
is released.

Alertmanager shops route every page through one tree (silences, inhibition, PagerDuty and
Opsgenie receivers); a halt belongs there as an alert, not only as a Slack message. The sink
only renders and posts (supervisor.notify.sink); the level loop (supervisor.notify.level) reads
what is halted, re-sends every `resend_s` with `endsAt` four intervals ahead, so an
Alertmanager that restarted empty, or was down, has the alerts again at the next round, and
posts a unit no longer quarantined once more as resolved (`endsAt` now), by the labels it was
sent with. The URL's credentials, if any, never reach a log.

The alert is the shipped Prometheus rule's, label for label (alertname, host, unit, severity;
deploy/prometheus/alerts.yml), so where both are configured Alertmanager deduplicates them into
one alert and one notification per halt. Labels are only what the rule can know too: the crash's
signature and its own severity travel as annotations, and `severity` is the routing one
(`critical`: a unit is down).

With `[fleet] share` on, a halt the fleet shares also fires `VllmSupervisorFleetHalt`
(supervisor.fleet: the crash's and the environment's fingerprints as labels), which the other
hosts read and the shipped route groups per crash. Every alert goes to each Alertmanager of an
HA cluster (`url` and `peers`): a cluster gossips silences, not alerts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import structlog

from ..actions.evidence import ENVIRONMENT_KEY
from ..config import AlertmanagerConfig, Config
from ..decide.fleet import host_name
from ..environment.fingerprint import fleet_digest
from ..errors import NotifyError
from ..fleet import fleet_alert
from ..story import NO_ROOT_CAUSE
from ..telemetry.http import SinkState
from ..util.http import (
    MAX_BODY_BYTES,
    bounded,
    encode_json,
    one_line,
    read_bounded,
    unexpected_error,
)
from ..util.urls import redact_all, url_problem
from .sink import DELIVERED, Incidents, Mode, Pacing, Result, Round, failed

_log = structlog.get_logger(__name__)

ALERT_NAME = "VllmSupervisorUnitHalted"
SEVERITY = "critical"  # a halted unit serves nothing until someone acts: it pages
# The README section that says what a halt is and what to do (the rule's runbook_url too).
RUNBOOK_URL = (
    "https://github.com/vllm-supervisor/vllm-supervisor/blob/main/README.md"
    "#vllmsupervisorunithalted"
)
if TYPE_CHECKING:
    import httpx


def alert(unit: str, record: Mapping[str, Any], *, host: str) -> dict[str, Any]:
    """The firing alert of a unit's quarantine record: the labels the shipped rule gives the
    same halt (bounded, no free text); what only the record knows goes in annotations."""
    labels = {"alertname": ALERT_NAME, "host": host, "unit": unit, "severity": SEVERITY}
    annotations = {
        "summary": f"{unit} on {host} is halted: {record.get('title') or 'a fatal crash'}",
        "signature": str(record.get("signature") or "unknown"),
        "crash_severity": str(record.get("severity") or "unknown"),
        "root_cause": str(record.get("root_cause") or NO_ROOT_CAUSE),
        "remediation": str(record.get("remediation") or ""),
        "release": f"vllm-supervisor release {unit}",
        "invocation_id": str(record.get("invocation_id") or ""),
        "halted_since": str(record.get("time") or ""),
        "runbook_url": RUNBOOK_URL,
    }
    return {"labels": labels, "annotations": {k: v for k, v in annotations.items() if v}}


def _label_sets(sent: object) -> list[Any]:
    """What a unit was sent open as: its alerts' label sets, by alert name (an earlier version
    kept the one alert's labels themselves)."""
    if isinstance(sent, dict) and sent and all(isinstance(v, dict) for v in sent.values()):
        return list(sent.values())
    return [sent]


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


class AlertmanagerSink:
    """Renders the halted units as alerts and posts them to Alertmanager's API."""

    mode = Mode.LEVEL
    name = "alertmanager"

    def __init__(
        self,
        config: AlertmanagerConfig,
        *,
        host: str,
        share: bool = False,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._url = config.url  # None: off
        self._urls = config.urls()  # its HA peers too: they gossip silences, not alerts
        # Why one cannot be used (config validation refuses it; a hand-built config may not).
        self._problem = next((p for u in self._urls if (p := url_problem(u))), None)
        self._endpoints = [u.rstrip("/") + "/api/v2/alerts" for u in self._urls]
        self._host = host
        self._share = share  # also publish the fleet's alerts (supervisor.fleet)
        self._transport = transport
        self._client: httpx.AsyncClient | None = None
        if self.state().state == "on":
            # Made now, not at the first halt: building its TLS context takes a while, and
            # the first halt's alert should not wait for it.
            self._connection()
        self.pacing = Pacing(
            timeout_s=config.timeout_s,
            backoff_max_s=config.backoff_max_s,
            resend_s=config.resend_s,
            min_interval_s=0.0,
        )

    def state(self) -> SinkState:
        """On, off without a URL, or invalid_url with why (never the URL)."""
        if self._url is None:
            return SinkState("off", "no alertmanager.url")
        if self._problem is not None:
            return SinkState("invalid_url", f"alertmanager.url unusable: {self._problem}")
        return SinkState("on")

    def render(self, subject: Incidents) -> Round | None:
        """The firing alerts of what is open (each halt's own, and its fleet alert when it is
        the fleet's business: supervisor.fleet), and the resolved ones of what was sent open
        and is no longer (or is open under other labels); None when there is nothing to say."""
        now = subject.now
        firing = {u: self._alerts(u, r) for u, r in subject.open.items()}
        ends = _iso(now + 4 * self.pacing.resend_s)
        body = [
            {**a, "startsAt": a["annotations"].get("halted_since") or _iso(now), "endsAt": ends}
            for alerts in firing.values()
            for a in alerts
        ]
        # A unit's identity: its alerts' labels by alert name (a JSON object, as the incident
        # table keeps one).
        open_labels = {
            u: {a["labels"]["alertname"]: a["labels"] for a in alerts}
            for u, alerts in firing.items()
        }
        body += [
            {"labels": labels, "startsAt": _iso(now - 1), "endsAt": _iso(now)}
            for unit, sent in subject.sent.items()
            for labels in _label_sets(sent)
            if labels not in open_labels.get(unit, {}).values()
        ]
        if not body:
            return None
        return Round(body=body, open=open_labels)

    def _alerts(self, unit: str, record: Mapping[str, Any]) -> list[dict[str, Any]]:
        halted = alert(unit, record, host=self._host)
        if not self._share:
            return [halted]
        environment = fleet_digest(record.get(ENVIRONMENT_KEY))
        shared = fleet_alert(unit, record, host=self._host, environment=environment)
        return [halted] if shared is None else [halted, shared]

    def resent(self, payload: Round | None) -> Round | None:
        """Unchanged: Alertmanager deduplicates alerts by their labels."""
        return payload

    async def send(self, payload: Round | None, *, timeout_s: float) -> Result:
        """One POST of the round's alerts; classified and redacted."""
        if payload is None:
            return DELIVERED
        try:
            content = encode_json(payload.body, "alertmanager")
        except NotifyError as exc:
            return failed(exc)
        error = await self._post(content, timeout_s)
        return DELIVERED if error is None else failed(error)

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self._client is not None:
            await self._client.aclose()

    def _connection(self) -> httpx.AsyncClient:
        import httpx  # where it is used (see notify.webhook on why)

        if self._client is None:
            self._client = httpx.AsyncClient(trust_env=False, transport=self._transport)
        return self._client

    async def _post(self, content: bytes, timeout_s: float) -> NotifyError | None:
        """One POST to every Alertmanager of the cluster at once (as Prometheus sends to each);
        None when one took it at least, else the first classified, redacted error. One
        instance down does not fail the round: what it missed, a resolved alert included,
        reaches the others, and the next rounds bring it what is still firing."""
        posts = (self._post_one(endpoint, content, timeout_s) for endpoint in self._endpoints)
        errors = await asyncio.gather(*posts)
        failed = [error for error in errors if error is not None]
        if failed and len(failed) < len(errors):
            _log.warning("alertmanager_peer_failed", error=str(failed[0]), peers=len(failed))
            return None
        return failed[0] if failed else None

    async def _post_one(
        self, endpoint: str, content: bytes, timeout_s: float
    ) -> NotifyError | None:
        import httpx

        headers = {"Content-Type": "application/json"}
        try:
            client = self._connection()
            async with client.stream(
                "POST", endpoint, content=content, headers=headers, timeout=timeout_s
            ) as r:
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
        return redact_all(text, self._urls)


def build_sink(config: Config) -> AlertmanagerSink:
    """The Alertmanager sink for `config` (off without `alertmanager.url`)."""
    # One name for this host in every alert: `fleet.host`, by default the machine's hostname,
    # which is what the shipped Prometheus rule takes from `instance` (so the two deduplicate,
    # and the fleet's alert inhibits the halt's own by host and unit).
    return AlertmanagerSink(config.alertmanager, host=host_name(config), share=config.fleet.share)
