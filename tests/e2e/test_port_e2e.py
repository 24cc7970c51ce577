"""A port held by another user's process, under a real systemd 252 (in systemd-nspawn).

An orphaned server (here `python3 -m http.server` in a unit of its own, run as the user
`holder`, uid 991, started first) holds the served unit's port. Before, `Address already in
use` was transient: the served unit restarted into the same error for as long as the holder
lived (19 times in 100 s). Then the socket that listened when PID 1 started the unit, still
listening at its crash, halted the loop at the first crash; but the hardened daemon
(`PrivateUsers=yes`) saw neither the holder's open files nor its uid, and its record and Slack
message blamed "a process of uid 65534". Now the daemon names the holder by the cgroup its
socket was opened in (sock_diag) and by the uid systemd runs that unit as (D-Bus): its PID,
command line, unit, user and uid. The gate (root) refuses starts while the port is held, naming
the holder as it sees it, and lifts the halt once the holder is stopped; the unit then serves.
"""

from __future__ import annotations

import json
import socket

import pytest
from nspawn import Container, wait_for
from served import (
    CONDITION_SKIPPED,
    QUARANTINE,
    UNIT,
    container,
    history,
    invocations_that_ran,
    settled,
    start_supervisor,
    supervisor_events,
    unit_lines,
)
from slack_server import SlackServer
from test_trust_e2e import FAKE, install, serving_now

pytestmark = pytest.mark.nspawn
__all__ = ["container"]  # the fixture, used by name

BLOCKER = "blocker.service"
HOLDER, HOLDER_UID = "holder", 991
OVERFLOW_UID = "65534"
CONFIG = """[[unit]]
name = "{unit}"
port = {port}

[slack]
min_interval_s = 0.01

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


def block(box: Container, port: int, *, sec: str) -> str:
    """The served unit (binding `port`, `RestartSec=sec`) and another user's server holding
    that port first, in a unit of its own; the holder's command line."""
    box.write_file("/etc/sysusers.d/holder.conf", f"u {HOLDER} {HOLDER_UID} - -\n")
    box.run("systemd-sysusers")
    command = f"/usr/bin/python3 -m http.server {port} --bind 127.0.0.1"
    box.write_file(
        f"/etc/systemd/system/{BLOCKER}", f"[Service]\nUser={HOLDER}\nExecStart={command}\n"
    )
    install(box, f"{FAKE} --bind {port}", sec=sec)
    box.systemctl("start", BLOCKER)
    wait_for(lambda: listening(box, port), timeout=20, what="the blocker to listen")
    return command


def gate_says(box: Container, words: str) -> bool:
    """True once a line of the served unit's journal (the gate's own included) has `words`."""
    return any(words in str(e.get("MESSAGE")) for e in unit_lines(box))


def test_a_port_held_by_another_users_unit_is_named_and_halts_the_first_crash(
    container: Container, slack: SlackServer
) -> None:
    """One run, halted with the real holder named in history, record and Slack message (never
    uid 65534); refused while the port is held, let through once the holder is gone."""
    port = free_port()
    assert container.run("getent", "passwd", str(HOLDER_UID), check=False).returncode != 0
    command = block(container, port, sec="100ms")
    holder_pid = container.show(BLOCKER, "MainPID")["MainPID"]
    start_supervisor(container, CONFIG.format(unit=UNIT, port=port))
    container.write_file("/etc/vllm-supervisor/slack-webhook", slack.url, mode="0600")
    container.systemctl("restart", "vllm-supervisor.service")
    wait_for(lambda: len(supervisor_events(container, "following_journal")) >= 2, timeout=30,
             what="the supervisor to follow again, with Slack on")  # fmt: skip
    container.systemctl("start", "--no-block", UNIT)
    wait_for(lambda: (settled(container) and history(container)) or None, timeout=40,
             what="the served unit to be halted")  # fmt: skip
    assert len(invocations_that_ran(container)) == 1
    first, *rest = history(container)
    assert [r["decision"]["rule"] for r in rest] in ([], ["skipped"]), rest
    assert first["verdict"]["signature"] == "port_in_use"
    assert first["verdict"]["severity"] == "fatal"
    assert first["decision"]["rule"] == "port_held"
    assert first["taken"] == "halted"
    named = f"PID {holder_pid} ({command}) of {BLOCKER} (user {HOLDER}, uid {HOLDER_UID})"
    assert f"port {port} is held by {named}" in first["decision"]["reason"], first
    assert first["verdict"]["confidence"] == "high"  # the holder's start is known: before
    record = json.loads(container.run("cat", QUARANTINE).stdout)
    assert named in record["reason"]
    assert record["evidence"] == {"kind": "port_held", "port": port}
    wait_for(lambda: slack.count() >= 1, timeout=20, what="the Slack message")
    message = json.dumps(slack.requests[0].json())
    assert named in message
    for said in (json.dumps(first), json.dumps(record), message):
        assert OVERFLOW_UID not in said
    # preflight reads the interpreter from ExecStart= over D-Bus (as the daemon's drift does)
    # and names the holder of the configured port.
    report = json.loads(
        container.run("vllm-supervisor", "preflight", UNIT, "--format", "json", check=False).stdout
    )
    assert (report["python"], report["port"], report["ok"]) == ("/usr/bin/python3", port, False)
    port_check = next(c for c in report["checks"] if c["check"] == "port")
    assert "http.server" in port_check["detail"], port_check
    # While the holder lives the gate refuses a start, and its line names the holder.
    skips = sum(1 for e in unit_lines(container) if e.get("MESSAGE_ID") == CONDITION_SKIPPED)
    container.systemctl("start", UNIT, check=False)
    wait_for(lambda: sum(1 for e in unit_lines(container)
                         if e.get("MESSAGE_ID") == CONDITION_SKIPPED) > skips,
             timeout=20, what="the gate to skip the start")  # fmt: skip
    assert gate_says(container, "start refused, quarantined: ")
    assert gate_says(container, f"{UNIT}: port {port} is still held by {named}")  # as root sees
    # Once the holder is gone, the gate lifts the halt by itself: no release needed.
    container.systemctl("stop", BLOCKER)
    container.systemctl("start", "--no-block", UNIT)
    wait_for(lambda: serving_now(container), timeout=30, what="the unit to serve again")
    assert gate_says(container, f"the halt is lifted, port {port} is free now")
    assert len(invocations_that_ran(container)) == 2
