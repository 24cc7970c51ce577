"""Slack incoming webhooks: one delivery attempt, classified.

`SlackWebhook.send` makes one attempt and classifies the result the way Alertmanager's
`Retrier.Check` does: 2xx delivered; 5xx, 429 and transport errors (TLS included) retryable;
any other status permanent. Whatever else fails is a `NotifyError` too: a URL httpx cannot use
(`InvalidURL`, an `OverflowError` for a port past 65535) or a payload it cannot encode is
permanent, so a message can never crash the daemon at every start (a poison message). The
webhook URL is the secret: it never appears in an error, a log line, a repr or a metric label
(Alertmanager's `RedactURL`), and a reply is redacted before it is cut.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable, Mapping
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..config import Secret
from ..errors import NotifyError
from ..util.http import (
    ERROR_TEXT_LIMIT,
    MAX_BODY_BYTES,
    bounded,
    encode_json,
    one_line,
    read_bounded,
    unexpected_error,
)
from ..util.urls import MIN_SECRET_SEGMENT, REDACTED, url_problem
from ..util.urls import redact as redact_text

if TYPE_CHECKING:
    # Imported where a request is made: httpx and the ssl context it builds cost ~4 MB of RSS,
    # which an idle daemon (nothing to tell yet) need not hold.
    import httpx

DEFAULT_TIMEOUT_S = 10.0
_JSON = {"Content-Type": "application/json"}
__all__ = [
    "ERROR_TEXT_LIMIT",
    "MIN_SECRET_SEGMENT",
    "REDACTED",
    "SlackRateLimited",
    "SlackWebhook",
    "redact",
]

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


# -- delivery ------------------------------------------------------------------------------------


class SlackRateLimited(NotifyError):
    """Slack answered 429; `retry_after` is its Retry-After in seconds, when it sent one."""

    def __init__(self, message: str, *, retry_after: float | None) -> None:
        super().__init__(message, reason="rate_limited", retryable=True)
        self.retry_after = retry_after


def redact(text: str, url: Secret) -> str:
    """`text` with the webhook URL (and its secret path) replaced by a marker."""
    return redact_text(text, url.value)


class _RedactFilter(logging.Filter):
    """Strips the webhook URL from httpx's own INFO log ("HTTP Request: POST <url> ...")."""

    def __init__(self, url: Secret) -> None:
        super().__init__()
        self._url = url

    def filter(self, record: logging.LogRecord) -> bool:
        import httpx  # loaded already: only httpx logs through this filter

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
        self.problem = url_problem(url.value)  # why it can never be sent to; None: usable
        self._now = now
        self._transport = transport
        self._timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None  # made at the first send
        self._filter = _RedactFilter(url)
        logging.getLogger("httpx").addFilter(self._filter)

    def _connection(self) -> httpx.AsyncClient:
        import httpx

        if self._client is None:
            # identity: an error body is read raw and cut at MAX_BODY_BYTES, never decompressed.
            self._client = httpx.AsyncClient(
                transport=self._transport,
                timeout=self._timeout_s,
                follow_redirects=False,
                headers={"Accept-Encoding": "identity"},
            )
        return self._client

    @property
    def url(self) -> Secret:
        """The URL, as the secret it is (its repr is masked)."""
        return self._url

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
        if self._client is not None:
            await self._client.aclose()
        logging.getLogger("httpx").removeFilter(self._filter)

    async def send(self, payload: Mapping[str, Any], *, timeout_s: float | None = None) -> None:
        """Post `payload` once; raises `NotifyError` (or `SlackRateLimited`) when not delivered.

        Only the first MAX_BODY_BYTES of the reply are read, so an HTML error page, an endless
        or a huge body costs bounded memory. `timeout_s` overrides the client's timeout.
        """
        import httpx

        if self.problem is not None:
            raise NotifyError(
                f"slack: the webhook URL {self.problem}", reason="invalid_url", retryable=False
            )
        if not isinstance(payload, Mapping):  # a stored message read back as another JSON value
            raise NotifyError(
                "slack: the message is not a JSON object", reason="unrenderable", retryable=False
            )
        content = encode_json(dict(payload), "slack")
        client = self._connection()
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else httpx.Timeout(timeout_s)
        try:
            async with client.stream(
                "POST", self._url.value, content=content, headers=_JSON, timeout=timeout
            ) as response:
                if not 200 <= response.status_code < 300:
                    body = await read_bounded(response, MAX_BODY_BYTES)
                    self._check(response.status_code, response.headers, body)
        except NotifyError:
            raise
        except httpx.HTTPError as exc:
            # `from None`: the httpx exception holds the request and thus the URL.
            raise self._transport_error(exc) from None
        except Exception as exc:  # every error becomes a classified NotifyError
            raise unexpected_error(exc, "slack") from None

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
        # Redact before cutting: a cut inside the URL leaves a piece no pattern recognises.
        text = bounded(redact(one_line(body.decode("utf-8", "replace")), self._url))
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
    import httpx

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
