"""The gate's line to the running daemon: no start passes before its last crash is decided.

The quarantine record alone loses the race at a short `RestartSec=` (systemd's default is
100 ms): the next start's `ExecCondition=` gate can run before the daemon has read the crash.
So the gate asks the daemon, over a Unix socket in its runtime directory, and the daemon answers
once it has read the journal up to that start (PID 1's "Starting U..." carries the start's
`INVOCATION_ID`, which systemd also gives the gate in its environment) and decided every ended
invocation of the unit before it. The gate then reads the quarantine record, as always.

One JSON line each way. Requests: `{"op": "gate", "unit": U, "invocation_id": ID}` and
`{"op": "released", "unit": U}` (from `release`, so the daemon forgets its streak and clears
its halted gauge at once). Answers: `{"ok": true, ...}` or `{"ok": false, "error": ...}`.
The socket is the daemon's (mode 0660 in its 0750 runtime directory); the gate runs as root.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from ..util.jsontext import loads

log = structlog.get_logger(__name__)

SOCKET_NAME = "gate.sock"
MAX_REQUEST_BYTES = 4096
READ_TIMEOUT_S = 5.0  # a client that connects and says nothing is dropped after this
SOCKET_MODE = 0o660

Ready = Callable[[str, str | None, float], Awaitable[dict[str, Any]]]
Released = Callable[[str], None]


def socket_path(runtime_dir: Path) -> Path:
    """Where the daemon listens for its gates."""
    return runtime_dir / SOCKET_NAME


class GateServer:
    """The daemon's side: answers each gate once the unit's past is decided."""

    def __init__(self, path: Path, *, ready: Ready, released: Released, wait_s: float) -> None:
        self.path = path
        self._ready = ready
        self._released = released
        self._wait_s = wait_s
        self._server: asyncio.AbstractServer | None = None
        self.waiting: dict[str, int] = {}  # unit -> gates waiting on an answer

    async def start(self) -> None:
        """Listen (replacing a stale socket a dead daemon left)."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        self.path.chmod(SOCKET_MODE)
        log.info("gate_socket_listening", path=str(self.path))

    async def close(self) -> None:
        """Stop listening; gates that connect afterwards find no daemon and say so."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    def is_waiting(self, unit: str) -> bool:
        """True while a gate of `unit` waits for the daemon's answer."""
        return self.waiting.get(unit, 0) > 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            answer = await self._answer(reader)
            writer.write(json.dumps(answer).encode() + b"\n")
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass  # the gate went away (its start was cancelled): nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader) -> dict[str, Any]:
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                line = await reader.readuntil(b"\n")
        except (TimeoutError, asyncio.LimitOverrunError, asyncio.IncompleteReadError):
            return {"ok": False, "error": "expected one JSON line"}
        request = _parse(line)
        if request is None:
            return {"ok": False, "error": "expected {'op': 'gate'|'released', 'unit': ...}"}
        op, unit = request["op"], request["unit"]
        if op == "released":
            self._released(unit)
            return {"ok": True}
        invocation_id = request.get("invocation_id")
        self.waiting[unit] = self.waiting.get(unit, 0) + 1
        started = time.monotonic()
        try:
            answer = await self._ready(unit, invocation_id, self._wait_s)
        finally:
            self.waiting[unit] -= 1
        log.info(
            "gate_answered",
            unit=unit,
            invocation_id=invocation_id,
            decided=answer.get("decided"),
            waited_ms=round((time.monotonic() - started) * 1000, 1),
        )
        return answer


def _parse(line: bytes) -> dict[str, Any] | None:
    if len(line) > MAX_REQUEST_BYTES:
        return None
    try:
        request = loads(line)
    except ValueError:
        return None
    if not isinstance(request, dict) or request.get("op") not in ("gate", "released"):
        return None
    if not isinstance(request.get("unit"), str) or not request["unit"]:
        return None
    if not isinstance(request.get("invocation_id"), str | None):
        return None
    return request


@dataclass(frozen=True, slots=True)
class Reply:
    """What the gate learned from the daemon."""

    reached: bool  # a daemon answered
    answer: dict[str, Any]
    note: str  # one line for the journal when it did not, or when it waited
    waited_s: float


def ask(path: Path, request: dict[str, Any], *, timeout_s: float) -> Reply:
    """Send one request to the daemon and wait (bounded) for its answer; never raises."""
    started = time.monotonic()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(os.fspath(path))
            sock.sendall(json.dumps(request).encode() + b"\n")
            data = _read_line(sock)
    except (FileNotFoundError, ConnectionRefusedError):
        return Reply(False, {}, f"no supervisor is running (nothing listens on {path})", 0.0)
    except TimeoutError:
        waited = time.monotonic() - started
        return Reply(False, {}, f"the supervisor did not answer within {waited:.0f} s", waited)
    except OSError as exc:
        return Reply(False, {}, f"cannot reach the supervisor at {path}: {exc.strerror}", 0.0)
    waited = time.monotonic() - started
    if not data:
        return Reply(False, {}, "the supervisor went away without answering", waited)
    try:
        answer = loads(data)
    except ValueError:
        return Reply(False, {}, "the supervisor's answer was not JSON", waited)
    if not isinstance(answer, dict):
        return Reply(False, {}, "the supervisor's answer was not a JSON object", waited)
    return Reply(True, answer, "", waited)


def _read_line(sock: socket.socket) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < MAX_REQUEST_BYTES:
        chunk = sock.recv(MAX_REQUEST_BYTES)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if b"\n" in chunk:
            break
    return b"".join(chunks)
