"""A loopback HTTP server standing in for Slack's incoming webhooks.

It records every request and answers from a script (a queue of replies; 200 "ok" once the
script is empty), optionally after a delay (a slow Slack). It can be stopped and started again
on the same port, which is how tests simulate Slack being down, and can serve HTTPS with a
given certificate (an untrusted one, for TLS errors).
"""

from __future__ import annotations

import contextlib
import json
import ssl
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SECRET = "XXsecretTOKENxx0123456789"  # noqa: S105 - a test token
WEBHOOK_PATH = f"/services/T0000000/B0000000/{SECRET}"


@dataclass(frozen=True)
class Reply:
    """One scripted answer."""

    status: int = 200
    body: str = "ok"
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0  # answer this much later (the request is recorded on arrival)


@dataclass(frozen=True)
class Request:
    """One recorded request."""

    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The body decoded as JSON."""
        return json.loads(self.body)


class SlackServer:
    """A threaded HTTP server on 127.0.0.1 that records requests and replies from a script."""

    def __init__(self, port: int = 0, *, tls: ssl.SSLContext | None = None) -> None:
        self.port = port
        self.tls = tls
        self.script: deque[Reply] = deque()
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._active = 0  # connections accepted and not yet closed
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The webhook URL, secret path included."""
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}{WEBHOOK_PATH}"

    def start(self) -> None:
        """Listen (on the same port as before, after a stop)."""
        self._server = _CountingServer(("127.0.0.1", self.port), self._handler_class(), self)
        self._server.daemon_threads = True
        if self.tls is not None:
            self._server.socket = self.tls.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop listening; connections are refused until `start`."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def reply(self, *replies: Reply) -> None:
        """Queue answers for the next requests."""
        with self._lock:
            self.script.extend(replies)

    def count(self) -> int:
        """Requests received so far."""
        with self._lock:
            return len(self.requests)

    def idle(self) -> bool:
        """True when no connection is open: every request that arrived has been recorded."""
        with self._lock:
            return self._active == 0

    def _busy(self, delta: int) -> None:
        with self._lock:
            self._active += delta

    def _record(self, request: Request) -> Reply:
        with self._lock:
            self.requests.append(request)
            return self.script.popleft() if self.script else Reply()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                body = self.rfile.read(length)
                reply = server._record(Request(self.path, dict(self.headers), body))
                time.sleep(reply.delay_s)  # a slow server, not synchronisation
                data = reply.body.encode()
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                """Silence the default stderr access log."""

            def handle(self) -> None:
                """A client that hung up early (a timeout, a cut body) is not an error here."""
                with contextlib.suppress(BrokenPipeError, ConnectionResetError, ssl.SSLError):
                    super().handle()

        return Handler


class _CountingServer(ThreadingHTTPServer):
    """Counts open connections from accept to close, so a test can wait for the server to idle."""

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        owner: SlackServer,
    ) -> None:
        super().__init__(address, handler)
        self._owner = owner

    def process_request(self, request: Any, client_address: Any) -> None:
        self._owner._busy(1)  # in the accepting thread, before the handler thread exists
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        try:
            super().shutdown_request(request)
        finally:
            self._owner._busy(-1)
