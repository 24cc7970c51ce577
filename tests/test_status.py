"""`vllm-supervisor status`: the halted unit, why and since when, and the daemon's own health.

A real daemon (a child process of the test) follows a real journal and halts a fatal crash;
`status` reads the quarantine record, the history, the daemon's lock and its /healthz over HTTP
on loopback. Without systemd to ask (none runs here) the unit's systemd state is said to be
unknown, with why; the rest is shown all the same.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for
from fakedaemon import FakeDaemon
from faults.harness import Supervisor, classified, crash, write_config
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor import __version__, cli
from vllm_supervisor.commands.status import (
    EXIT_DAEMON_DOWN,
    EXIT_HALTED,
    EXIT_HEALTHY,
    DaemonStatus,
    Status,
    _unit_status,
    ask_health,
    render_text,
)
from vllm_supervisor.journal.writer import JournalWriter

UNIT = "vllm.service"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def status(config: Path, *args: str) -> tuple[int, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "vllm_supervisor", "status", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if "--format" in args:
        return done.returncode, json.loads(done.stdout)
    return done.returncode, done.stdout


@pytest.fixture
def supervised(tmp_path: Path) -> Any:
    """A running daemon that has halted one fatal crash of vllm.service."""
    config = write_config(tmp_path)
    port = free_port()
    config.write_text(config.read_text().replace("127.0.0.1:0", f"127.0.0.1:{port}"))
    sup = Supervisor(tmp_path, config, env={"DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/no/bus"})
    with JournalWriter(tmp_path / "journal") as writer:
        writer.write(crash("fatal", 1))
        sup.start()
        try:
            wait_for(lambda: len(classified(tmp_path / "state")) == 1, timeout=60, what="the halt")
            yield sup
        finally:
            sup.stop_quietly()


def test_a_halted_unit_and_a_healthy_daemon(supervised: Supervisor) -> None:
    """Exit 1; the record's signature, cause, time and release command; the daemon's pid and
    /healthz; the verdict in the unit's last verdicts."""
    code, report = status(supervised.config, "--format", "json")
    assert code == EXIT_HALTED
    (unit,) = report["units"]
    assert unit["unit"] == UNIT
    assert unit["halted"]["signature"] == "flashinfer_cubin_mismatch"
    assert "flashinfer-cubin version" in unit["halted"]["root_cause"]
    assert unit["halted"]["time"]
    assert unit["systemd"] is None and "systemd not reachable" in unit["systemd_error"]
    assert [v["action"] for v in unit["last"]] == ["halt"]
    daemon = report["daemon"]
    assert (daemon["running"], daemon["pid"], daemon["healthy"]) == (True, supervised.pid, True)
    assert daemon["health"]["following"] is True
    code, text = status(supervised.config)
    assert code == EXIT_HALTED
    assert f"release:   vllm-supervisor release {UNIT}" in text
    assert (
        "HALTED" in text
        and f"running (pid {supervised.pid}, version {__version__}), healthy" in text
    )


def test_released_is_healthy_and_stopped_is_down(supervised: Supervisor) -> None:
    """After `release` the exit status is 0; with the daemon stopped it is 3, said in words."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_supervisor",
            "release",
            UNIT,
            "--config",
            str(supervised.config),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert status(supervised.config)[0] == EXIT_HEALTHY
    supervised.terminate()
    code, text = status(supervised.config)
    assert code == EXIT_DAEMON_DOWN
    assert "vllm-supervisor: NOT RUNNING (the supervisor is not running)" in text


def test_health_that_does_not_answer_is_said(tmp_path: Path) -> None:
    """A closed port or a body that is not JSON is a reason in words, never a traceback."""
    assert "ConnectError" in str(ask_health(f"http://127.0.0.1:{free_port()}/healthz"))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)
RECORD = st.dictionaries(
    st.sampled_from(
        ["time", "invocation_id", "signature", "severity", "root_cause", "remediation"]
    ),
    JSON,
) | st.dictionaries(st.text(max_size=12), JSON, max_size=4)


@given(
    record=st.none() | RECORD,
    history=st.lists(
        JSON
        | st.fixed_dictionaries(
            {"unit": st.just(UNIT)},
            optional={
                "verdict": JSON,
                "decision": JSON,
                "drift": JSON,
                "time": JSON,
                "taken": JSON,
            },
        ),
        max_size=5,
    ),
    health=st.dictionaries(st.text(max_size=12), JSON, max_size=5),
    healthy=st.none() | st.booleans(),
)
def test_any_record_history_or_health_reply_renders(
    record: dict[str, Any] | None, history: list[Any], health: dict[str, Any], healthy: bool | None
) -> None:
    """Files on disk and a /healthz reply are outside input: none of them breaks the screen."""
    halted = None if record is None else {**record, "path": "/run/x.json"}
    unit = _unit_status(UNIT, "systemd not reachable", halted, history)
    daemon = DaemonStatus(running=True, pid=1, healthy=healthy, health=health)
    text = render_text(Status(units=(unit,), daemon=daemon))
    assert text.startswith(f"● {UNIT}: ")
    json.dumps(Status(units=(unit,), daemon=daemon).to_json(), default=str)


def status_in_process(tmp_path: Path, metrics_port: int, *args: str) -> tuple[int, str]:
    """`status` through `cli.main`, with the harness config listening on `metrics_port`.

    Output goes to a StringIO, not capsys: `main` points the log at the stderr it finds, and
    a later test's log line must not meet a closed capture."""
    config = write_config(tmp_path)
    config.write_text(config.read_text().replace("127.0.0.1:0", f"127.0.0.1:{metrics_port}"))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(["status", "--config", str(config), *args])
    return code, out.getvalue()


@pytest.fixture
def no_systemd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path}/no-bus")


@pytest.mark.usefixtures("no_systemd")
def test_a_stranger_on_the_metrics_port_is_not_the_daemon(tmp_path: Path) -> None:
    """A process that is not the lock file's daemon answers a healthy /healthz on the metrics
    port (a local user bound it while the daemon restarted): not healthy, exit 3, and who."""
    supervisor_pid = os.getppid()  # alive, and not the process that listens
    with FakeDaemon(tmp_path / "state", pid=supervisor_pid) as stranger:
        code, text = status_in_process(tmp_path, stranger.port)
        json_code, raw = status_in_process(tmp_path, stranger.port, "--format", "json")
    assert code == json_code == EXIT_DAEMON_DOWN
    assert (
        f"metrics port {stranger.port} held by PID {os.getpid()} (" in text
        and f"not the supervisor (pid {supervisor_pid})" in text
    ), text
    assert ", healthy" not in text
    report = json.loads(raw)
    assert report["daemon"]["healthy"] is None
    assert f"not the supervisor (pid {supervisor_pid})" in report["daemon"]["squatter"]


@pytest.mark.usefixtures("no_systemd")
def test_the_daemon_on_its_own_metrics_port_is_trusted(tmp_path: Path) -> None:
    """The same answer from the lock file's own pid is the daemon's health: exit 0."""
    with FakeDaemon(tmp_path / "state", pid=os.getpid()) as daemon:
        code, text = status_in_process(tmp_path, daemon.port)
    assert code == EXIT_HEALTHY, text
    assert f"running (pid {os.getpid()}), healthy" in text
