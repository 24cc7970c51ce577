"""JSON nested deeper than the parser's recursion limit is text that is not JSON, everywhere.

`json.loads("[" * 5000)` raises RecursionError, not the ValueError every reader of outside JSON
catches: a quarantine record, a gate's request on the daemon's socket, a line of a saved journal,
a /healthz reply or a state database row of that shape went past each reader's guard. 4 KiB of
brackets is enough (the gate socket's request limit).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import socket
import sqlite3
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor import cli
from vllm_supervisor.actions.gatekeeper import GateServer, socket_path
from vllm_supervisor.actions.quarantine import Quarantine, record_name
from vllm_supervisor.commands.status import ask_health
from vllm_supervisor.store import DATABASE_NAME, Store
from vllm_supervisor.util.jsontext import loads

UNIT = "vllm.service"
DEEP = "[" * 4000  # within the gate socket's 4 KiB, past the parser's recursion limit


def _command(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(argv)
    return code, out.getvalue()


def _config(root: Path) -> Path:
    path = root / "supervisor.toml"
    path.write_text(
        f'[systemd]\nenabled = false\n[state]\nstate_dir = "{root / "state"}"\n'
        f'runtime_dir = "{root / "run"}"\n[[unit]]\nname = "{UNIT}"\n',
        encoding="utf-8",
    )
    return path


NESTED = st.integers(1, 20_000).flatmap(
    lambda depth: st.sampled_from(["[", '{"a":', '[{"b":']).map(lambda o: o * depth)
)


@given(st.one_of(st.text(max_size=200), NESTED, NESTED.map(lambda t: t + "1" + "]" * 9)))
def test_loads_gives_a_value_or_value_error(text: str) -> None:
    """For any text: a JSON value, or ValueError (never RecursionError)."""
    with contextlib.suppress(ValueError):
        loads(text)


class TestQuarantineRecord:
    @pytest.fixture(name="root")
    def _root(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
        monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path}/no-bus")
        directory = tmp_path / "run" / "quarantine"
        directory.mkdir(parents=True)
        (directory / record_name(UNIT)).write_text(DEEP, encoding="utf-8")
        return tmp_path

    def test_it_is_read_as_corrupt(self, root: Path) -> None:
        """A corrupt record, still a record (fail closed)."""
        record = Quarantine(root / "run" / "quarantine").read(UNIT)
        assert record is not None and record["corrupt"] is True

    def test_the_gate_refuses_and_release_removes_it(self, root: Path) -> None:
        """The gate refuses on it in words (exit 1), `release` removes it, then the gate lets
        the start through; `status` and `preflight` answer."""
        config = ["--config", str(_config(root))]
        code, text = _command(["gate", *config, UNIT])
        assert (code, cli.UNEXPECTED in text) == (1, False), text
        assert "record is unreadable" in text
        for argv in (["status", *config], ["preflight", *config, UNIT]):
            code, text = _command(argv)
            assert cli.UNEXPECTED not in text, (argv, text)
        code, text = _command(["release", *config, UNIT])
        assert (code, cli.UNEXPECTED in text) == (0, False), text
        assert _command(["gate", *config, UNIT])[0] == 0


def test_triage_of_a_deep_json_line_is_one_line(tmp_path: Path) -> None:
    """A saved journal whose second line is `[[[[...`: one line naming the line, exit 2."""
    path = tmp_path / "journal.json"
    path.write_text('{"MESSAGE": "starting"}\n' + DEEP + "\n", encoding="utf-8")
    code, text = _command(["triage", str(path)])
    assert code == 2, text
    assert cli.UNEXPECTED not in text, text
    assert text.count("\n") == 1 and "line 2" in text, text


def test_history_with_a_deep_row_answers(tmp_path: Path) -> None:
    """A history row of deep JSON is left out; the rest is shown."""
    config = _config(tmp_path)
    Store.in_directory(tmp_path / "state").close()
    db = sqlite3.connect(tmp_path / "state" / DATABASE_NAME, isolation_level=None)
    db.execute(
        "INSERT INTO history (unit, invocation_id, time, outcome) VALUES (?, 'a', 1, ?)",
        (UNIT, DEEP),
    )
    db.close()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["history", "--config", str(config), "--format", "json"])
    assert code == 0
    assert json.loads(out.getvalue()) == {"invocations": []}


class _Deep(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = DEEP.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(name="deep_server")
def _deep_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Deep)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/healthz"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_a_deep_healthz_reply_is_a_reason(deep_server: str) -> None:
    """`status` asking /healthz of whatever answers on the port: a reason in words."""
    answer = ask_health(deep_server)
    assert isinstance(answer, str) and "ValueError" in answer, answer


async def test_the_daemon_answers_a_deep_gate_request_and_the_next_one(tmp_path: Path) -> None:
    """A local process sends `[[[[...` to the gate socket: it gets an error answer, and the
    next gate is answered as before."""

    async def ready(unit: str, invocation_id: str | None, wait_s: float) -> dict[str, Any]:
        return {"ok": True, "decided": True}

    server = GateServer(socket_path(tmp_path), ready=ready, released=lambda _: None, wait_s=1)
    await server.start()
    try:
        answers = [
            await asyncio.to_thread(_ask_raw, socket_path(tmp_path), line)
            for line in (DEEP.encode(), json.dumps({"op": "gate", "unit": UNIT}).encode())
        ]
    finally:
        await server.close()
    assert answers[0]["ok"] is False
    assert answers[1] == {"ok": True, "decided": True}


def _ask_raw(path: Path, line: bytes) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(line + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    answer: dict[str, Any] = json.loads(data) if data else {}
    return answer
