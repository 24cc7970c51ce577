"""A port held by another process, under a real systemd 252 (in systemd-nspawn).

An orphaned server (here `python3 -m http.server` in a unit of its own, started first) holds
the served unit's port. Before, `Address already in use` was transient: the served unit
restarted into the same error for as long as the holder lived (19 times in 100 s). Now the
socket that listened when PID 1 started the unit, still listening at its crash, halts the loop
at the first crash (the daemon's user cannot see root's open files, the socket table it can);
once the holder is stopped and the unit released, it starts and serves.
"""

from __future__ import annotations

import json
import socket

import pytest
from nspawn import Container, wait_for
from served import UNIT, container, history, invocations_that_ran, settled, start_supervisor
from test_trust_e2e import FAKE, install, serving_now

pytestmark = pytest.mark.nspawn
__all__ = ["container"]  # the fixture, used by name

BLOCKER = "blocker.service"
CONFIG = """[[unit]]
name = "{unit}"
port = {port}

[metrics]
listen = "127.0.0.1:9464"
"""


def free_port() -> int:
    """A port free on loopback now (the container shares this host's network)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def listening(box: Container, port: int) -> bool:
    connect = f"import socket; socket.create_connection(('127.0.0.1', {port}), 1)"
    return box.run("/usr/bin/python3", "-c", connect, check=False).returncode == 0


def test_a_port_held_by_another_unit_halts_the_first_crash(container: Container) -> None:
    """One run, halted with the holder named; released after the holder is gone, it serves."""
    port = free_port()
    container.write_file(
        f"/etc/systemd/system/{BLOCKER}",
        f"[Service]\nExecStart=/usr/bin/python3 -m http.server {port} --bind 127.0.0.1\n",
    )
    install(container, f"{FAKE} --bind {port}", sec="100ms")
    container.systemctl("start", BLOCKER)
    wait_for(lambda: listening(container, port), timeout=20, what="the blocker to listen")
    start_supervisor(container, CONFIG.format(unit=UNIT, port=port))
    container.systemctl("start", "--no-block", UNIT)
    wait_for(lambda: (settled(container) and history(container)) or None, timeout=40,
             what="the served unit to be halted")  # fmt: skip
    assert len(invocations_that_ran(container)) == 1
    first, *rest = history(container)
    assert [r["decision"]["rule"] for r in rest] in ([], ["skipped"]), rest
    assert first["verdict"]["signature"] == "port_in_use"
    assert first["verdict"]["severity"] == "fatal"
    assert first["decision"]["rule"] == "port_held"
    assert f"port {port} is held by" in first["decision"]["reason"]
    assert first["taken"] == "halted"
    # preflight reads the interpreter from ExecStart= over D-Bus (as the daemon's drift does)
    # and names the holder of the configured port.
    report = json.loads(
        container.run("vllm-supervisor", "preflight", UNIT, "--format", "json", check=False).stdout
    )
    assert (report["python"], report["port"], report["ok"]) == ("/usr/bin/python3", port, False)
    port_check = next(c for c in report["checks"] if c["check"] == "port")
    assert "http.server" in port_check["detail"], port_check
    container.systemctl("stop", BLOCKER)
    container.run("vllm-supervisor", "release", UNIT)
    container.systemctl("start", "--no-block", UNIT)
    wait_for(lambda: serving_now(container), timeout=30, what="the released unit to serve")
    assert len(invocations_that_ran(container)) == 2
