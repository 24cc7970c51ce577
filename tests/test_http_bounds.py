"""/metrics and /healthz stay up while any local user opens connections and says nothing.

Before the bounds, 3000 half-open connections exhausted the daemon's 1024 file descriptors:
/healthz timed out and asyncio logged a traceback for every failed accept(). The server now
holds at most `max_connections` (the oldest silent one makes room), drops a client that sends
no request head within the read timeout, bounds the head, and logs shedding and accept errors
once per burst.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from vllm_supervisor.telemetry.http import MetricsServer
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

SILENT = 1500  # connections that connect and never send a byte
HEADROOM = 300  # descriptors left for everything else, far fewer than SILENT
HEALTHZ_DEADLINE_S = 5.0


def _open_fds() -> int:
    return sum(1 for _ in Path("/proc/self/fd").iterdir())


@pytest.fixture(name="fd_limit")
def _fd_limit() -> Iterator[int]:
    """A soft limit that SILENT client sockets fit in, but not twice over (the server's side
    of each, were it to keep them all); restored afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = _open_fds() + SILENT + HEADROOM
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {wanted}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    yield wanted
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _silent_clients(port: int, count: int) -> list[socket.socket]:
    """`count` non-blocking connects to `port` that will never send anything."""
    clients = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        err = sock.connect_ex(("127.0.0.1", port))
        assert err in (0, errno.EINPROGRESS), os.strerror(err)
        clients.append(sock)
    return clients


async def _get(port: int, path: str, timeout_s: float = 1.0) -> bytes | None:
    """One GET on a fresh connection; None when it is refused, reset or not answered."""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            await writer.drain()
            data = await reader.read()
            writer.close()
            return data or None
    except (OSError, TimeoutError):
        return None


async def _healthz_within(port: int, deadline_s: float) -> bytes:
    """Ask /healthz on fresh connections until one answers; fail after `deadline_s`."""
    answers: list[bytes] = []

    async def ask() -> None:
        answer = await _get(port, "/healthz")
        if answer is not None:
            answers.append(answer)

    start = time.monotonic()
    while not answers:
        if time.monotonic() - start > deadline_s:
            pytest.fail(f"/healthz did not answer within {deadline_s}s")
        await ask()
    return answers[0]


def _lines(logs: list[dict[str, Any]], caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every log line of the server (structlog) and of asyncio (stdlib)."""
    return [repr(e) for e in logs] + [r.getMessage() for r in caplog.records]


async def test_silent_connections_cannot_starve_healthz(
    fd_limit: int, caplog: pytest.LogCaptureFixture
) -> None:
    """SILENT connections that send nothing: /healthz on a fresh one answers at once, the
    server holds at most its cap, and the log says so in a line or two, not thousands."""
    caplog.set_level(logging.WARNING)
    server = MetricsServer(Metrics(new_registry(process=False)), lambda: (True, {"reasons": []}))
    clients: list[socket.socket] = []
    with structlog.testing.capture_logs() as logs:
        await server.start("127.0.0.1", 0)
        try:
            baseline = _open_fds()
            clients = _silent_clients(server.port, SILENT)
            answer = await _healthz_within(server.port, HEALTHZ_DEADLINE_S)
            assert answer.startswith(b"HTTP/1.1 200"), answer[:80]
            server_side = _open_fds() - baseline - len(clients)
            assert server_side <= 64 + 8, f"the server holds {server_side} connections"
        finally:
            for sock in clients:
                sock.close()
            await server.close()
    lines = _lines(logs, caplog)
    assert len([line for line in lines if "accept" in line or "shed" in line]) <= 3, lines[:5]


async def test_a_silent_client_is_dropped_after_the_read_timeout() -> None:
    """A connection that never completes its request head is closed by the server."""
    server = MetricsServer(
        Metrics(new_registry(process=False)), lambda: (True, {}), read_timeout_s=0.2
    )
    await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(b"GET /metrics HTTP/1.1\r\n")  # and never the blank line
        async with asyncio.timeout(5):
            assert await reader.read() == b""  # closed by the server
        writer.close()
    finally:
        await server.close()


async def test_an_oversized_head_is_refused() -> None:
    """A request head past the bound gets no answer but a closed connection, and the server
    keeps serving."""
    server = MetricsServer(Metrics(new_registry(process=False)), lambda: (True, {}))
    await server.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        with contextlib.suppress(ConnectionError):
            writer.write(b"GET /healthz HTTP/1.1\r\nX: " + b"a" * 100_000 + b"\r\n\r\n")
            await writer.drain()
        async with asyncio.timeout(5):
            with contextlib.suppress(ConnectionError):
                assert not (await reader.read()).startswith(b"HTTP/1.1 200")
        writer.close()
        assert (await _get(server.port, "/healthz") or b"").startswith(b"HTTP/1.1 200")
    finally:
        await server.close()
