"""End to end under a real systemd 252 (in systemd-nspawn): restart loops halted for real.

The container boots the host's own OS tree with the shipped deploy files bound in at their
install paths: the supervisor unit, the served unit's ExecCondition drop-in, the polkit rule and
the sysusers.d entry that creates the `vllm-supervisor` user. A fake `vllm.service` prints a saved
crash log and exits 1 under `Restart=always`. No test overrides the supervisor unit: the only
test-specific drop-in sets the served unit's RestartSec=, and the repository and this Python are
bound under /opt and reached through a wrapper at /usr/local/bin/vllm-supervisor, because the
test Python lives under /root, which the unit's ProtectHome=yes hides.

These tests fail (never skip) when nspawn cannot run: they are the proof that halting works.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from nspawn import Container, booted_container, wait_for

pytestmark = pytest.mark.nspawn

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DATA = Path(__file__).resolve().parent / "data"
UNIT = "vllm.service"
QUARANTINE = "/run/vllm-supervisor/quarantine/vllm.service.json"

SERVER_BANNER = "vLLM API server version"  # the first line of every crash log in data/
PROCESS_EXITED = "98e322203f7a4ed290d09fe03c09fe15"
JOB_STARTED = "39f53479d3a045ac8e11786248231fbf"
JOB_STOPPED = "9d1aaa27d60140bd96365438aad20286"
CONDITION_SKIPPED = "0e4284a0caca4bfc81c0bb6786972673"

WRAPPER = """#!/bin/sh
# The test Python, relocated under /opt (its RUNPATH points into /root, hidden by ProtectHome).
export LD_LIBRARY_PATH=/opt/vsup/python/lib PYTHONPATH=/opt/vsup/src PYTHONDONTWRITEBYTECODE=1
exec /opt/vsup/python/bin/python3 -m supervisor "$@"
"""

SERVED_UNIT = """[Unit]
Description=fake inference server for the e2e tests
# A model that loads for minutes never trips the start limit; keep the fast fake just as free.
StartLimitIntervalSec=0

[Service]
ExecStart=/bin/sh -c 'cat /opt/vsup/e2e/{log}; exit 1'
Restart=always
"""

SUPERVISOR_CONFIG = """[[unit]]
name = "vllm.service"
unknown_repeat_limit = 3

[metrics]
listen = "127.0.0.1:9464"
"""

LATENCIES: list[float] = []


@pytest.fixture
def container(tmp_path: Path) -> Iterator[Container]:
    """A booted container with the shipped deploy files installed."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "vllm-supervisor"
    wrapper.write_text(WRAPPER)
    wrapper.chmod(0o755)
    binds = [
        (sys.base_prefix, "/opt/vsup/python"),
        (REPO, "/opt/vsup/src"),
        (DATA, "/opt/vsup/e2e"),
        (bindir, "/usr/local/bin"),
        (DEPLOY / "systemd/vllm-supervisor.service", "/etc/systemd/system/vllm-supervisor.service"),
        (
            DEPLOY / "systemd/vllm.service.d/10-vllm-supervisor.conf",
            "/etc/systemd/system/vllm.service.d/10-vllm-supervisor.conf",
        ),
        (
            DEPLOY / "polkit/50-vllm-supervisor.rules",
            "/etc/polkit-1/rules.d/50-vllm-supervisor.rules",
        ),
        (DEPLOY / "sysusers.d/vllm-supervisor.conf", "/etc/sysusers.d/vllm-supervisor.conf"),
    ]
    assert sys.prefix == sys.base_prefix, "run the e2e tests with a non-venv Python"
    with booted_container(binds, workdir=tmp_path) as booted:
        yield booted


def install_served_unit(box: Container, log: str, restart_sec: str) -> None:
    """Write the fake served unit and the test's RestartSec= drop-in, then reload systemd."""
    box.write_file(f"/etc/systemd/system/{UNIT}", SERVED_UNIT.format(log=log))
    box.write_file(
        f"/etc/systemd/system/{UNIT}.d/50-e2e-restartsec.conf",
        f"[Service]\nRestartSec={restart_sec}\n",
    )
    box.systemctl("daemon-reload")


def start_supervisor(box: Container) -> None:
    """Start the shipped supervisor unit (Type=notify: returns once it sent READY=1)."""
    box.write_file("/etc/vllm-supervisor/supervisor.toml", SUPERVISOR_CONFIG)
    box.write_file("/etc/vllm-supervisor/slack-webhook", "", mode="0600")
    proc = box.systemctl("start", "vllm-supervisor.service", check=False)
    if proc.returncode != 0:
        log = box.run("journalctl", "--no-pager", "-u", "vllm-supervisor.service", check=False)
        pytest.fail(f"vllm-supervisor.service did not start:\n{log.stdout[-4000:]}")


def unit_lines(box: Container) -> list[dict[str, str]]:
    """Every journal entry about the served unit: its own lines and PID 1's messages."""
    return box.journal("-u", UNIT)


def invocations_that_ran(box: Container) -> set[str]:
    """Invocation ids of the served unit that ran ExecStart (printed the server banner)."""
    # The gate's own output also carries the unit and its invocation id, so look at the text.
    return {
        e["_SYSTEMD_INVOCATION_ID"]
        for e in unit_lines(box)
        if e.get("_SYSTEMD_UNIT") == UNIT and SERVER_BANNER in str(e.get("MESSAGE"))
    }


def condition_skips(box: Container) -> int:
    """How often systemd skipped a start of the served unit because ExecCondition failed."""
    return sum(1 for e in unit_lines(box) if e.get("MESSAGE_ID") == CONDITION_SKIPPED)


def n_restarts(box: Container) -> int:
    """systemd's restart counter of the served unit."""
    return int(box.show(UNIT, "NRestarts")["NRestarts"])


def quarantined(box: Container) -> bool:
    """True once the supervisor wrote the served unit's quarantine record."""
    return box.run("test", "-f", QUARANTINE, check=False).returncode == 0


def halt_latency(box: Container) -> tuple[float, float]:
    """(exit -> quarantine written, exit -> unit down) in seconds, from the journal and mtime."""
    entries = unit_lines(box)
    exited = max(
        int(e["__REALTIME_TIMESTAMP"]) for e in entries if e.get("MESSAGE_ID") == PROCESS_EXITED
    )
    down = [
        int(e["__REALTIME_TIMESTAMP"])
        for e in entries
        if e.get("MESSAGE_ID") in (JOB_STOPPED, CONDITION_SKIPPED)
        and int(e["__REALTIME_TIMESTAMP"]) >= exited
    ]
    mtime_ns = int(box.run("stat", "-c", "%.9Y", QUARANTINE).stdout.strip().replace(".", ""))
    return (mtime_ns / 1000 - exited) / 1e6, (min(down) - exited) / 1e6 if down else float("nan")


class TestSystemdMechanism:
    """What the halting design relies on, proven on this systemd without the daemon."""

    def test_unit_crash_loops_under_restart_always(self, container: Container) -> None:
        """A crashing unit with Restart=always is restarted again and again by systemd."""
        install_served_unit(container, "flashinfer-crash.log", "100ms")
        container.systemctl("start", "--no-block", UNIT)
        wait_for(lambda: n_restarts(container) >= 3, timeout=30, what="three restarts")

    def test_gate_skips_start_and_stops_the_loop(self, container: Container) -> None:
        """With a quarantine record the ExecCondition gate skips the start and nothing restarts."""
        install_served_unit(container, "flashinfer-crash.log", "100ms")
        container.write_file(QUARANTINE, '{"signature": "manual", "reason": "e2e"}\n', "0640")
        container.systemctl("start", UNIT, check=False)
        wait_for(
            lambda: condition_skips(container), timeout=20, what="the start skipped by the gate"
        )
        assert n_restarts(container) == 0
        assert invocations_that_ran(container) == set()
        state = container.show(UNIT, "ActiveState", "SubState", "Result")
        assert state["ActiveState"] == "inactive"
        assert state["SubState"] == "dead"

    def test_release_lets_the_unit_start_again(self, container: Container) -> None:
        """`vllm-supervisor release` removes the record and the next start runs the server."""
        install_served_unit(container, "flashinfer-crash.log", "30s")
        container.write_file(QUARANTINE, '{"signature": "manual"}\n', "0640")
        container.systemctl("start", UNIT, check=False)
        out = container.run("vllm-supervisor", "release", UNIT).stdout
        assert "released vllm.service" in out
        container.systemctl("start", UNIT, check=False)
        wait_for(
            lambda: len(invocations_that_ran(container)) == 1,
            timeout=20,
            what="the released unit to run",
        )
