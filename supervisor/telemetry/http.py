"""The supervisor's own HTTP endpoint: `/metrics` for Prometheus and `/healthz` for probes.

A minimal HTTP/1.1 server on `asyncio.start_server`: one request per connection, GET and HEAD
only, bounded request size and read time. Two fixed routes do not justify a web framework
(aiohttp would add a large dependency tree to a daemon that must stay small). Bound to
127.0.0.1 by default (config `metrics.listen`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import structlog

from .metrics import Metrics

HealthCheck = Callable[[], tuple[bool, dict[str, Any]]]
"""Returns (healthy, details); details are rendered as the JSON body of /healthz."""

MAX_REQUEST_BYTES = 8192
READ_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 10.0

_log = structlog.get_logger()


class MetricsServer:
    """Serves the registry of `metrics` and the injected health check over HTTP."""

    def __init__(
        self,
        metrics: Metrics,
        health: HealthCheck,
        *,
        before_scrape: Callable[[], None] = lambda: None,
    ) -> None:
        self._metrics = metrics
        self._health = health
        self._before_scrape = before_scrape  # e.g. read which units are quarantined right now
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The bound port (useful after binding port 0)."""
        if self._server is None or not self._server.sockets:
            raise RuntimeError("MetricsServer is not started")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self, host: str = "127.0.0.1", port: int = 9464) -> None:
        """Bind and start serving; raises OSError when the address is taken."""
        self._server = await asyncio.start_server(self._handle, host, port)
        _log.info("metrics_server_started", host=host, port=self.port)

    async def close(self) -> None:
        """Stop accepting connections and wait for the listener to close."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read one request, answer it, close the connection; never raises."""
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            method, path = _request_line(head)
            status, ctype, body = self._route(method, path)
            if method == "HEAD":
                writer.write(_response_head(status, ctype, len(body)))
            else:
                writer.write(_response_head(status, ctype, len(body)) + body)
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass  # a client that sent no complete request gets no answer
        except ValueError:
            writer.write(_response_head(HTTPStatus.BAD_REQUEST, "text/plain", 0))
        except (ConnectionError, OSError) as exc:
            _log.debug("metrics_client_error", error=type(exc).__name__)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError, TimeoutError):
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    await writer.wait_closed()

    def _route(self, method: str, path: str) -> tuple[HTTPStatus, str, bytes]:
        """Pick the answer for a request."""
        if method not in ("GET", "HEAD"):
            return HTTPStatus.METHOD_NOT_ALLOWED, "text/plain; charset=utf-8", b"GET only\n"
        route = path.split("?", 1)[0]
        if route == "/metrics":
            try:
                self._before_scrape()
            except OSError as exc:
                _log.warning("metrics_refresh_failed", error=str(exc))
            body, ctype = self._metrics.exposition()
            return HTTPStatus.OK, ctype, body
        if route == "/healthz":
            return self._healthz()
        return HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"try /metrics or /healthz\n"

    def _healthz(self) -> tuple[HTTPStatus, str, bytes]:
        try:
            healthy, details = self._health()
        except Exception as exc:  # a broken check is itself unhealthy, never a crash
            healthy, details = False, {"error": type(exc).__name__}
        status = HTTPStatus.OK if healthy else HTTPStatus.SERVICE_UNAVAILABLE
        body = json.dumps({"healthy": healthy, **details}, sort_keys=True, default=str)
        return status, "application/json", body.encode() + b"\n"


def _request_line(head: bytes) -> tuple[str, str]:
    """(method, path) of a request head; ValueError when it is not HTTP/1.x."""
    if len(head) > MAX_REQUEST_BYTES:
        raise ValueError("request too large")
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise ValueError("not an HTTP/1.x request line")
    return parts[0], parts[1]


def _response_head(status: HTTPStatus, ctype: str, length: int) -> bytes:
    return (
        f"HTTP/1.1 {status.value} {status.phrase}\r\n"
        f"Content-Type: {ctype}\r\n"
        f"Content-Length: {length}\r\n"
        "Cache-Control: no-store\r\n"
        "Connection: close\r\n\r\n"
    ).encode("latin-1")


def combine_health(*checks: HealthCheck) -> HealthCheck:
    """One check that is healthy when all are; details are merged, `reasons` concatenated."""

    def check() -> tuple[bool, dict[str, Any]]:
        healthy, details, reasons = True, {}, []
        for one in checks:
            ok, more = one()
            healthy = healthy and ok
            reasons.extend(more.pop("reasons", []))
            details.update(more)
        return healthy, {**details, "reasons": reasons}

    return check


def following_check(metrics: Metrics) -> HealthCheck:
    """Healthy while the journal is followed (as last reported through `Metrics.following`)."""

    def check() -> tuple[bool, dict[str, Any]]:
        ok = metrics.is_following
        details: dict[str, Any] = {"following": ok}
        if metrics.lag_s is not None:  # once an entry was read
            details["journal_lag_s"] = round(metrics.lag_s, 3)
        return ok, {**details, "reasons": [] if ok else ["not following the journal"]}

    return check
