"""A daemon as `status` sees one: the flock on its lock file naming a pid, and /healthz.

The HTTP server runs in a thread of the test process, so the listening socket's owner is the
test's own pid; the lock file may name that pid (the real daemon) or another (a squatter
answering on the daemon's port while the daemon named in the lock restarts).
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType

LOCK_NAME = "daemon.lock"
HEALTHY = {"following": True, "journal_lag_s": 0.1, "outbox_depth": 0, "reasons": []}


class _Healthz(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps(HEALTHY).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


class FakeDaemon:
    """Holds `state_dir`'s daemon lock naming `pid`, and answers a healthy /healthz."""

    def __init__(self, state_dir: Path, *, pid: int) -> None:
        self.state_dir = state_dir
        self.pid = pid
        self._fd: int | None = None
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Healthz)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def __enter__(self) -> FakeDaemon:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.state_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.pwrite(fd, f"{self.pid}\n".encode(), 0)
        self._fd = fd
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)
        if self._fd is not None:
            os.close(self._fd)
