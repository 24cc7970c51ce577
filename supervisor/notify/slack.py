"""Slack incoming webhooks: the message for a crash, and one delivery attempt.

`build_payload` is pure: an `Outcome` in, a Block Kit payload out, with a plain `text` fallback.
Every piece of journal text is escaped (`& < >`), so a log line cannot ping `<!channel>` or
forge a link, and every block stays within Slack's size limits (cut with a visible marker).

`SlackWebhook.send` makes one attempt and classifies the result the way Alertmanager's
`Retrier.Check` does: 2xx delivered; 5xx, 429 and transport errors (TLS included) retryable;
any other status permanent. The webhook URL is the secret: it never appears in an error, a log
line, a repr or a metric label (Alertmanager's `RedactURL`).
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Any

import httpx

from supervisor.config import Secret
from supervisor.errors import NotifyError
from supervisor.model import Action, Ending, Outcome, Severity, Taken

SECTION_LIMIT = 3000  # Slack: a section's text, a context element
FIELD_LIMIT = 2000  # Slack: one section field
HEADER_LIMIT = 150  # Slack: a header block's plain_text
FALLBACK_LIMIT = 3000  # our own bound for the top-level `text`
ERROR_TEXT_LIMIT = 200  # Slack's error body quoted in a NotifyError
MAX_BODY_BYTES = 4096  # at most this much of a reply is read: a huge or endless body is cut
TRUNCATED = "… [truncated]"
REDACTED = "<redacted>"
DEFAULT_TIMEOUT_S = 10.0
MIN_SECRET_SEGMENT = 8  # path segments this long are redacted on their own ("services" too)

# Error codes Slack documents for incoming webhooks; any other 4xx body becomes "http_4xx" so
# the metric label stays bounded.
SLACK_ERRORS = frozenset(
    {
        "invalid_payload",
        "invalid_blocks",
        "invalid_blocks_format",
        "invalid_token",
        "missing_text_or_fallback_or_attachments",
        "no_text",
        "no_service",
        "no_service_id",
        "no_team",
        "team_disabled",
        "channel_not_found",
        "channel_is_archived",
        "action_prohibited",
        "posting_to_general_channel_denied",
        "too_many_attachments",
        "user_not_found",
    }
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Group:
    """Transient crashes of one unit+signature folded into one message."""

    count: int
    first: float  # unix time of the first crash in the group
    last: float  # unix time of the latest
    interval_s: float  # the grouping interval


# -- the message ---------------------------------------------------------------------------------


def escape(text: str) -> str:
    """Escape Slack's control characters so text can never become a mention or a link."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def truncate(text: str, limit: int) -> str:
    """Cut already-escaped text to `limit` characters, marking the cut, never inside `&..;`."""
    if len(text) <= limit:
        return text
    cut = text[: max(0, limit - len(TRUNCATED))]
    amp = cut.rfind("&", max(0, len(cut) - 5))
    if amp != -1 and ";" not in cut[amp:]:
        cut = cut[:amp]
    return cut + TRUNCATED


def _code(text: str) -> str:
    """Escaped text inside a code block; a ``` in the text would end the block early."""
    return "```" + escape(text.replace("```", "`\u200b``")) + "```"


def _section(title: str, body: str) -> dict[str, Any]:
    text = truncate(f"*{title}*\n{body}", SECTION_LIMIT)
    return {"type": "section", "text": {"type": "mrkdwn", "text": text}}


def _field(title: str, body: str) -> dict[str, str]:
    return {"type": "mrkdwn", "text": truncate(f"*{title}*\n{body}", FIELD_LIMIT)}


def _action_line(action: Taken, unit: str) -> str:
    """What happened to the unit, and how a person undoes it."""
    release = f"`vllm-supervisor release {escape(unit)}`"
    return {
        Taken.HALTED: f":octagonal_sign: Halted: systemd will not restart it. "
        f"After fixing the cause, release it: {release}",
        Taken.QUARANTINED: f":octagonal_sign: Quarantined: its gate refuses the next start, but "
        f"systemd was not told (see the decision). After fixing the cause: {release}",
        Taken.HALT_FAILED: ":rotating_light: Halt FAILED: the quarantine could not be written; "
        "systemd may start it again.",
        Taken.WOULD_HALT: ":warning: Dry run: no action taken (see the decision).",
        Taken.RESTARTING: ":repeat: Restarting: systemd restarts it.",
        Taken.RESTARTED: ":repeat: Restarted by the supervisor (systemd would not have).",
        Taken.RESTART_FAILED: ":rotating_light: Restart FAILED: the server stays down.",
        Taken.DOWN: ":red_circle: Down: nothing restarts it.",
        Taken.RECORDED: ":scroll: Read late: recorded only, no action taken "
        "(it is not the unit's present run).",
        Taken.OBSERVED: ":eyes: Observed: no action taken.",
    }[action]


def _group_line(group: Group) -> str:
    start = datetime.fromtimestamp(group.first, UTC).strftime("%H:%M")
    end = datetime.fromtimestamp(group.last, UTC).strftime("%H:%M UTC")
    minutes = max(1, round(group.interval_s / 60))
    return (
        f"{group.count} crash{'es' if group.count != 1 else ''} of this kind between {start} "
        f"and {end} (grouped per {minutes} min)"
    )


def _crash_site(outcome: Outcome) -> str | None:
    site, cause = outcome.verdict.crash_site, outcome.verdict.root_cause
    if not site or (cause and site in cause):
        return None
    return site


def _header(outcome: Outcome, host: str, group: Group | None) -> str:
    unit = outcome.invocation.unit or "unknown unit"
    if outcome.taken is Taken.RECORDED and group is not None and group.count > 1:
        title = f"{group.count} past crashes read late"
    else:
        title = outcome.verdict.title
    return truncate(escape(f"{title} — {unit} on {_host(outcome, host)}"), HEADER_LIMIT)


def _host(outcome: Outcome, host: str) -> str:
    """The host the invocation ran on (a journal directory may hold another's)."""
    return outcome.invocation.hostname or host


def _when(outcome: Outcome) -> str:
    """When it ended, UTC, to the second."""
    ended = outcome.invocation.ended_us
    if ended is None:
        return "unknown"
    return datetime.fromtimestamp(ended / 1e6, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _fields(outcome: Outcome, host: str) -> list[dict[str, str]]:
    verdict, inv = outcome.verdict, outcome.invocation
    signature = verdict.signature or f"unknown (fingerprint {verdict.fingerprint or 'none'})"
    restarts = "unknown" if inv.restarts is None else str(inv.restarts)
    return [
        _field("Host", escape(_host(outcome, host))),
        _field("Unit", escape(inv.unit or "unknown")),
        _field("Signature", escape(signature)),
        _field("Severity", escape(verdict.severity.value)),
        _field("Ended", escape(_when(outcome))),
        _field("Invocation", escape(inv.invocation_id or "unknown")),
        _field("Restarts", restarts),
        _field("Exit", escape(_exit_text(outcome))),
    ]


def _exit_text(outcome: Outcome) -> str:
    inv = outcome.invocation
    parts = [p for p in (inv.exit_code, inv.result) if p]
    if inv.exit_status is not None:
        parts.append(f"status {inv.exit_status}")
    if inv.oom_killed:
        parts.append("OOM-killed")
    if inv.hung:
        parts.append("engine hung")
    return ", ".join(parts) or "unknown"


def _blocks(
    outcome: Outcome, host: str, action: Taken, group: Group | None
) -> list[dict[str, Any]]:
    verdict, unit = outcome.verdict, outcome.invocation.unit or "unknown"
    header = _header(outcome, host, group)
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": header}},
        {"type": "section", "fields": _fields(outcome, host)},
        _section("Root cause", _code(verdict.root_cause or "no root-cause line found")),
    ]
    site = _crash_site(outcome)
    if site:
        blocks.append(_section("Crash site", _code(site)))
    if verdict.remediation:
        blocks.append(_section("Remediation", escape(verdict.remediation)))
    if outcome.drift:
        changed = escape("; ".join(outcome.drift))
        blocks.append(_section("Changed since the last good start", changed))
    if group is not None and group.count > 1:
        blocks.append(_section("Grouped", escape(_group_line(group))))
    if verdict.notes:
        blocks.append(_section("Notes", escape("; ".join(verdict.notes))))
    blocks.append(_section("Action", _action_line(action, unit)))
    blocks.append(_section("Full log", _code(_log_command(outcome))))
    said = f"Decision: {outcome.decision.reason}"
    if outcome.taken_detail:
        said += f". Done: {outcome.taken_detail}"
    reason = truncate(escape(said), SECTION_LIMIT)
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": reason}]})
    return blocks


def _log_command(outcome: Outcome) -> str:
    """The command that shows the invocation's whole log."""
    inv = outcome.invocation
    if inv.invocation_id:
        ident = inv.invocation_id
        return f"journalctl _SYSTEMD_INVOCATION_ID={ident} + INVOCATION_ID={ident}"
    return f"journalctl -u {inv.unit or 'UNIT'}"


def _fallback(outcome: Outcome, host: str, action: Taken, group: Group | None) -> str:
    """The plain `text`: what notifications and clients without Block Kit show."""
    verdict, unit = outcome.verdict, outcome.invocation.unit or "unknown"
    restarts = outcome.invocation.restarts
    lines = [
        f"{_header(outcome, host, group)} ({verdict.severity.value}, "
        f"restarts: {'unknown' if restarts is None else restarts})",
        f"Ended {_when(outcome)}, invocation {outcome.invocation.invocation_id or 'unknown'}",
        f"Root cause: {verdict.root_cause or 'no root-cause line found'}",
    ]
    if outcome.invocation.hung:
        lines.append(
            "Engine hung: it logged its death and the unit stayed up past the grace period"
        )
    if outcome.drift:
        lines.append(f"Changed since the last good start: {'; '.join(outcome.drift)}")
    if group is not None and group.count > 1:
        lines.append(_group_line(group))
    lines.append(f"Action: {action.value}")
    if action in (Taken.HALTED, Taken.QUARANTINED):
        lines.append(f"Release: vllm-supervisor release {unit}")
    return truncate(escape("\n".join(lines)), FALLBACK_LIMIT)


def build_payload(outcome: Outcome, *, host: str, group: Group | None = None) -> dict[str, Any]:
    """The webhook body for one crash (or a group of transient or late ones); pure."""
    action = outcome.taken
    return {
        "text": _fallback(outcome, host, action, group),
        "blocks": _blocks(outcome, host, action, group),
    }


# How an invocation ended without a crash worth telling: a person's stop, a start the gate
# skipped (the halt was already told), the host's reboot, a saved journal's still-running one.
_NOT_NEWS = frozenset(
    {Ending.STOPPED, Ending.SKIPPED, Ending.GATE_STOPPED, Ending.BOOT, Ending.OPEN}
)


def is_notable(outcome: Outcome) -> bool:
    """True for an invocation worth a message: systemd saw a failure or the lines show a crash,
    or systemd gave up restarting it; never a person's stop or a skipped start."""
    ending = outcome.invocation.ending
    if ending is Ending.START_LIMIT:
        return True
    if ending in _NOT_NEWS:
        return False
    return outcome.invocation.failed or outcome.verdict.crashed


def group_key(outcome: Outcome) -> str | None:
    """Messages folded together: crashes read late, one summary per unit; transient crashes per
    unit and signature. Fatal, unknown and acted-on crashes are never folded."""
    unit = outcome.invocation.unit
    if outcome.taken is Taken.RECORDED:
        return f"{unit}\x00backlog"
    transient = (
        outcome.verdict.severity is Severity.TRANSIENT
        and outcome.verdict.signature is not None
        and outcome.decision.action is not Action.HALT
    )
    return f"{unit}\x00{outcome.verdict.signature}" if transient else None


def is_backlog(key: str | None) -> bool:
    """True for the group of crashes read late."""
    return key is not None and key.endswith("\x00backlog")


# -- delivery ------------------------------------------------------------------------------------


class SlackRateLimited(NotifyError):
    """Slack answered 429; `retry_after` is its Retry-After in seconds, when it sent one."""

    def __init__(self, message: str, *, retry_after: float | None) -> None:
        super().__init__(message, reason="rate_limited", retryable=True)
        self.retry_after = retry_after


def redact(text: str, url: Secret) -> str:
    """`text` with the webhook URL (and its secret path) replaced by a marker."""
    for secret in _secret_parts(url):
        text = text.replace(secret, REDACTED)
    return text


def _secret_parts(url: Secret) -> list[str]:
    """The URL, its path and query, and each long path segment (the token), longest first."""
    parsed = httpx.URL(url.value)
    parts = [url.value, parsed.path, parsed.query.decode("ascii", "replace")]
    parts += [seg for seg in parsed.path.split("/") if len(seg) >= MIN_SECRET_SEGMENT]
    return sorted({p for p in parts if len(p) > 1}, key=len, reverse=True)


class _RedactFilter(logging.Filter):
    """Strips the webhook URL from httpx's own INFO log ("HTTP Request: POST <url> ...")."""

    def __init__(self, url: Secret) -> None:
        super().__init__()
        self._url = url

    def filter(self, record: logging.LogRecord) -> bool:
        if record.args:
            args = record.args if isinstance(record.args, tuple) else (record.args,)
            record.args = tuple(
                redact(str(a), self._url) if isinstance(a, str | httpx.URL) else a for a in args
            )
        record.msg = redact(str(record.msg), self._url)
        return True


class SlackWebhook:
    """One Slack incoming webhook; `send` makes one attempt and classifies the result."""

    def __init__(
        self,
        url: Secret,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        now: Callable[[], float] = time.time,
    ) -> None:
        self._url = url
        self._now = now
        # identity: an error body is read raw and cut at MAX_BODY_BYTES, never decompressed.
        self._client = httpx.AsyncClient(
            transport=transport,
            timeout=timeout_s,
            follow_redirects=False,
            headers={"Accept-Encoding": "identity"},
        )
        self._filter = _RedactFilter(url)
        logging.getLogger("httpx").addFilter(self._filter)

    def __repr__(self) -> str:
        return f"SlackWebhook(url={REDACTED!r})"

    async def __aenter__(self) -> SlackWebhook:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool and stop filtering httpx's log for this URL."""
        await self._client.aclose()
        logging.getLogger("httpx").removeFilter(self._filter)

    async def send(self, payload: Mapping[str, Any], *, timeout_s: float | None = None) -> None:
        """Post `payload` once; raises `NotifyError` (or `SlackRateLimited`) when not delivered.

        Only the first MAX_BODY_BYTES of the reply are read, so an HTML error page, an endless
        or a huge body costs bounded memory. `timeout_s` overrides the client's timeout.
        """
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else httpx.Timeout(timeout_s)
        try:
            async with self._client.stream(
                "POST", self._url.value, json=dict(payload), timeout=timeout
            ) as response:
                if not 200 <= response.status_code < 300:
                    body = await _read_bounded(response, MAX_BODY_BYTES)
                    self._check(response.status_code, response.headers, body)
        except httpx.HTTPError as exc:
            # `from None`: the httpx exception holds the request and thus the URL.
            raise self._transport_error(exc) from None

    def _transport_error(self, exc: httpx.HTTPError) -> NotifyError:
        """A retryable error naming what failed, without the URL."""
        reason = _transport_reason(exc)
        detail = redact(str(exc) or type(exc).__name__, self._url)
        return NotifyError(
            f"slack: {reason}: {type(exc).__name__}: {detail}", reason=reason, retryable=True
        )

    def _check(self, status: int, headers: httpx.Headers, body: bytes) -> None:
        """Alertmanager's Retrier.Check: 2xx ok, 5xx and 429 retryable, other codes permanent."""
        if 200 <= status < 300:
            return
        text = redact(_bounded(body.decode("utf-8", "replace")), self._url)
        if status == 429:
            retry_after = _retry_after(headers.get("retry-after"), self._now())
            raise SlackRateLimited(
                f"slack: rate limited (HTTP 429, retry after {retry_after}s): {text}",
                retry_after=retry_after,
            )
        if status >= 500:
            raise NotifyError(f"slack: HTTP {status}: {text}", reason="http_5xx", retryable=True)
        reason = text if text in SLACK_ERRORS else f"http_{status // 100}xx"
        raise NotifyError(f"slack: HTTP {status}: {text}", reason=reason, retryable=False)


def _transport_reason(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
        return "connect"  # the request never left: retrying it cannot duplicate a message
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLError | ssl.CertificateError):
            return "tls"
        cause = cause.__cause__ or cause.__context__
    if isinstance(exc, httpx.ConnectError):
        return "connect"
    return "transport"


async def _read_bounded(response: httpx.Response, limit: int) -> bytes:
    """At most `limit` bytes of the body; the rest is never read (the connection is dropped)."""
    if response.is_stream_consumed:
        return response.content[:limit]  # already in memory (a test transport)
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():
        chunks.append(chunk[: limit - size])
        size += len(chunks[-1])
        if size >= limit:
            break
    return b"".join(chunks)


def _bounded(text: str) -> str:
    """Slack's error body, one line, printable, at most ERROR_TEXT_LIMIT characters."""
    flat = "".join(c if c.isprintable() else " " for c in text.strip())
    return flat if len(flat) <= ERROR_TEXT_LIMIT else flat[: ERROR_TEXT_LIMIT - 1] + "…"


def _retry_after(value: str | None, now: float) -> float | None:
    """Retry-After in seconds: delta-seconds or an HTTP date (RFC 9110 §10.2.3)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - now)
    except (TypeError, ValueError):
        return None
