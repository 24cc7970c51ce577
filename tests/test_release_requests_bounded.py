"""Requests to the gate's socket cannot grow /metrics (a real daemon child, loopback HTTP).

Seen before: `{"op": "released", "unit": NAME}` for ever new names (the socket takes any unit
name) gave each name its own set of per-unit series, /metrics growing from 47 KB to 3.4 MB. A
release now touches the halted gauge of a unit that has series only.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

from conftest import wait_for
from test_start_serving import _running

from vllm_supervisor.actions.gatekeeper import ask, socket_path

NAMES = 100


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def _served(port: int) -> str | None:
    try:
        return _metrics(port)
    except OSError:
        return None


def test_release_requests_for_any_name_never_grow_metrics(tmp_path: Path) -> None:
    sup, port = _running(tmp_path)
    try:
        wait_for(lambda: _served(port), timeout=30, what="/metrics")
        before = _metrics(port)
        socket = socket_path(tmp_path / "run")
        for n in range(NAMES):
            reply = ask(socket, {"op": "released", "unit": f"name-{n}.service"}, timeout_s=5)
            assert reply.reached, reply.note
        after = _metrics(port)
        assert "name-0.service" not in after
        assert len(after) < len(before) * 1.2, (len(before), len(after))
        assert sup.alive(), sup.stderr_text()
    finally:
        sup.stop_quietly()
