"""The supervisor's own HTTP endpoint: `/metrics` for Prometheus and `/healthz` for probes.

A minimal HTTP/1.1 server: one request per connection, GET and HEAD only. Two fixed routes do
not justify a web framework (aiohttp would add a large dependency tree to a daemon that must
stay small). Bound to 127.0.0.1 by default (config `metrics.listen`), where any local user can
connect, so every resource is bounded: at most `max_connections` at once (the oldest one still
silent makes room for a new one, so a fresh probe is answered during a flood), a request head
within `read_timeout_s` and MAX_REQUEST_BYTES, and one log line per burst of shed connections
or failed accept()s (asyncio's own server logs a traceback for each, thousands a minute).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import structlog

from .metrics import Metrics

HealthCheck = Callable[[], tuple[bool, dict[str, Any]]]
"""Returns (healthy, details); details are rendered as the JSON body of /healthz."""


@dataclass(frozen=True, slots=True)
class SinkState:
    """A sink as /healthz (and so `status`) shows it. `state` is "on", "off" or "invalid_url";
    `last_error` is why the last attempt failed (None once one succeeds), or why the sink is
    off or unusable. Neither ever holds the sink's URL."""

    state: str
    last_error: str | None = None


MAX_REQUEST_BYTES = 8192
READ_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64
BACKLOG = 128
BURST_LOG_S = 10.0  # at most one line per this long about shed connections or accept errors
ACCEPT_PAUSE_S = 0.1  # after a failed accept() (no descriptor left): let some be freed

_log = structlog.get_logger()


@dataclass(slots=True)
class _Burst:
    """Counts an event and logs it at most once per BURST_LOG_S, with the count since."""

    event: str
    count: int = 0
    next_log: float = 0.0
    clock: Callable[[], float] = field(default=time.monotonic)

    def hit(self, **details: Any) -> None:
        self.count += 1
        now = self.clock()
        if now >= self.next_log:
            _log.warning(self.event, count=self.count, per_s=BURST_LOG_S, **details)
            self.count, self.next_log = 0, now + BURST_LOG_S


@dataclass(slots=True, eq=False)
class _Connection:
    """One accepted connection; `silent` until its request head is read."""

    sock: socket.socket
    task: asyncio.Task[None] | None = None
    writer: asyncio.StreamWriter | None = None  # once asyncio owns the socket
    started: bool = False
    silent: bool = True

    def drop(self) -> None:
        """Close it at once, whatever its task is doing."""
        if self.writer is not None:
            self.writer.transport.abort()  # asyncio closes the socket, unregistered first
        elif not self.started:
            self.sock.close()  # never handed to asyncio
        if self.task is not None:
            self.task.cancel()


class MetricsServer:
    """Serves the registry of `metrics` and the injected health check over HTTP."""

    def __init__(
        self,
        metrics: Metrics,
        health: HealthCheck,
        *,
        before_scrape: Callable[[], None] = lambda: None,
        max_connections: int = MAX_CONNECTIONS,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self._metrics = metrics
        self._health = health
        self._before_scrape = before_scrape  # e.g. read which units are quarantined right now
        self._max = max_connections
        self._read_timeout_s = read_timeout_s
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._open: dict[_Connection, None] = {}  # oldest first
        self._shed = _Burst("metrics_connections_shed")
        self._accept_failed = _Burst("metrics_accept_failed")

    @property
    def port(self) -> int:
        """The bound port (useful after binding port 0)."""
        if self._listener is None:
            raise RuntimeError("MetricsServer is not started")
        return int(self._listener.getsockname()[1])

    async def start(self, host: str = "127.0.0.1", port: int = 9464) -> None:
        """Bind and start serving; raises OSError when the address is taken."""
        self._listener = await _listen(host, port)
        self._accepting = asyncio.create_task(self._accept_loop(self._listener))
        _log.info("metrics_server_started", host=host, port=self.port)

    async def close(self) -> None:
        """Stop accepting, drop every open connection, close the listener."""
        listener, self._listener = self._listener, None
        accepting, self._accepting = self._accepting, None
        if accepting is not None:
            accepting.cancel()
        tasks = [c.task for c in self._open if c.task is not None]
        for conn in list(self._open):
            conn.drop()
        if listener is not None:
            listener.close()
        waiting = [t for t in (accepting, *tasks) if t is not None]
        if waiting:
            await asyncio.wait(waiting, timeout=WRITE_TIMEOUT_S)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ECONNABORTED, ...
                self._accept_failed.hit(error=exc.strerror or type(exc).__name__)
                await asyncio.sleep(ACCEPT_PAUSE_S)  # a pause for descriptors to be freed
                continue
            self._admit(sock)
            # Let handlers (a probe's answer, a dropped connection's close) run between accepts.
            await asyncio.sleep(0)

    def _admit(self, sock: socket.socket) -> None:
        """Serve `sock`, making room by dropping the oldest silent connection at the cap."""
        if len(self._open) >= self._max:
            oldest = next((c for c in self._open if c.silent), None)
            self._shed.hit(open=len(self._open))
            if oldest is None:  # every slot is answering a request: refuse the newcomer
                sock.close()
                return
            self._forget(oldest)
            oldest.drop()
        conn = _Connection(sock)
        self._open[conn] = None
        conn.task = asyncio.create_task(self._serve(conn))
        conn.task.add_done_callback(lambda _: self._forget(conn))

    def _forget(self, conn: _Connection) -> None:
        self._open.pop(conn, None)

    async def _serve(self, conn: _Connection) -> None:
        conn.started = True
        try:
            reader, writer = await asyncio.open_connection(sock=conn.sock, limit=MAX_REQUEST_BYTES)
        except OSError:  # reset meanwhile
            conn.sock.close()
            return
        except asyncio.CancelledError:  # dropped while being set up
            conn.sock.close()
            raise
        conn.writer = writer
        await self._handle(reader, writer, conn)

    async def _handle(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, conn: _Connection
    ) -> None:
        """Read one request, answer it, close the connection; never raises."""
        try:
            async with asyncio.timeout(self._read_timeout_s):
                head = await reader.readuntil(b"\r\n\r\n")
            conn.silent = False
            method, path = _request_line(head)
            status, ctype, body = self._route(method, path)
            if method == "HEAD":
                writer.write(_response_head(status, ctype, len(body)))
            else:
                writer.write(_response_head(status, ctype, len(body)) + body)
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
            pass  # a client that sent no complete request (or too large a one) gets no answer
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


async def _listen(host: str, port: int) -> socket.socket:
    """A non-blocking listening socket on the first address `host` resolves to."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


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


def sinks_check(sinks: Mapping[str, Callable[[], SinkState]]) -> HealthCheck:
    """Each sink's state under `sinks` (never unhealthy by itself: the outbox check judges
    Slack's backlog and failures)."""

    def check() -> tuple[bool, dict[str, Any]]:
        states = {name: state() for name, state in sinks.items()}
        return True, {
            "sinks": {n: {"state": s.state, "last_error": s.last_error} for n, s in states.items()},
            "reasons": [],
        }

    return check
