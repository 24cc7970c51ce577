"""HTTP pieces every outside call shares: a bounded read of a reply, one-line bounded error
text, a JSON body that cannot poison a queue, and an error outside httpx's own classified.

Below both the sinks (supervisor.notify) and the evidence that reads a shared store
(supervisor.decide.fleet): neither copies the other's. httpx is imported where a request is
made (its TLS context costs ~4 MB of RSS an idle daemon need not hold).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from ..errors import NotifyError

if TYPE_CHECKING:
    import httpx

ERROR_TEXT_LIMIT = 200  # a far end's error body quoted in an error
MAX_BODY_BYTES = 4096  # at most this much of a reply is read: a huge or endless body is cut


async def read_bounded(response: httpx.Response, limit: int) -> bytes:
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


def one_line(text: str) -> str:
    """One line of printable characters."""
    return "".join(c if c.isprintable() else " " for c in text.strip())


def bounded(text: str) -> str:
    """At most ERROR_TEXT_LIMIT characters of already redacted text."""
    return text if len(text) <= ERROR_TEXT_LIMIT else text[: ERROR_TEXT_LIMIT - 1] + "…"


def encode_json(payload: Any, sink: str) -> bytes:
    """The JSON body as httpx would send it; a payload it cannot encode is permanent."""
    try:
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        return text.encode("utf-8")
    except (TypeError, ValueError) as exc:  # NaN, a lone surrogate (UnicodeError), a set
        raise NotifyError(
            f"{sink}: the message cannot be rendered: {type(exc).__name__}",
            reason="unrenderable",
            retryable=False,
        ) from None


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups; anyio raises some in one."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def unexpected_error(exc: Exception, sink: str) -> NotifyError:
    """An error outside httpx's own: a URL it cannot use is permanent; anything else counts as
    an attempt (bounded by max_attempts). Only the type is named: the text may hold the URL."""
    import httpx

    leaves = _leaves(exc)
    names = ", ".join(sorted({type(leaf).__name__ for leaf in leaves}))
    # InvalidURL; OverflowError (a port past 65535); ValueError/UnicodeError (host encoding).
    if all(isinstance(leaf, httpx.InvalidURL | ValueError | OverflowError) for leaf in leaves):
        return NotifyError(f"{sink}: unusable URL ({names})", reason="invalid_url", retryable=False)
    return NotifyError(f"{sink}: unexpected error ({names})", reason="internal", retryable=True)
