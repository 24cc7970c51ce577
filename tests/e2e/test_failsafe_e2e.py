"""The supervisor's own mistakes never take a served unit down (real systemd 252 in nspawn).

Seen before on this systemd: one typo in the installed config (`unknown_repeat_limit = three`)
made the gate exit 2, so systemd skipped every start of every supervised unit
(`Skipped due to 'exec-condition'`) while `systemctl start` returned 0, and `systemctl reload`
returned 0 too with nothing saying the reload was refused.
"""

from __future__ import annotations

import pytest
from nspawn import Container, wait_for
from served import (
    SUPERVISOR_CONFIG,
    UNIT,
    condition_skips,
    container,
    history,
    quarantined,
    start_supervisor,
    supervisor_events,
)

pytestmark = pytest.mark.nspawn
__all__ = ["container"]  # the fixture, used by name

CONFIG_PATH = "/etc/vllm-supervisor/supervisor.toml"
TYPO_CONFIG = SUPERVISOR_CONFIG.replace("unknown_repeat_limit = 3", "unknown_repeat_limit = three")
SERVING_UNIT = """[Unit]
Description=a healthy server that just runs
StartLimitIntervalSec=0

[Service]
ExecStart=/bin/sleep 600
Restart=always
"""


def install_serving_unit(box: Container) -> None:
    box.write_file(f"/etc/systemd/system/{UNIT}", SERVING_UNIT)
    box.systemctl("daemon-reload")


def running(box: Container) -> bool:
    state = box.show(UNIT, "ActiveState", "SubState")
    return state["ActiveState"] == "active" and state["SubState"] == "running"


def test_a_config_typo_fails_the_reload_and_never_skips_a_start(container: Container) -> None:
    assert TYPO_CONFIG != SUPERVISOR_CONFIG
    start_supervisor(container)
    install_serving_unit(container)
    daemon_pid = container.show("vllm-supervisor.service", "MainPID")["MainPID"]

    container.write_file(CONFIG_PATH, TYPO_CONFIG)
    reload = container.systemctl("reload", "vllm-supervisor.service", check=False)
    assert reload.returncode != 0, "the reload of a config with a typo must fail visibly"
    status = container.systemctl(
        "status", "--no-pager", "-n", "20", "vllm-supervisor.service", check=False
    )
    assert "unknown_repeat_limit" in status.stdout, status.stdout
    # The running daemon kept its config and still runs, the same process.
    assert container.show("vllm-supervisor.service", "MainPID")["MainPID"] == daemon_pid
    assert container.show("vllm-supervisor.service", "ActiveState")["ActiveState"] == "active"

    container.systemctl("start", UNIT)
    wait_for(lambda: running(container), timeout=30, what="the served unit to run")
    assert condition_skips(container) == 0


def test_a_daemon_that_refuses_its_config_stays_down_and_lets_starts_through(
    container: Container,
) -> None:
    start_supervisor(container)
    install_serving_unit(container)
    container.write_file(CONFIG_PATH, TYPO_CONFIG)
    container.systemctl("restart", "vllm-supervisor.service", check=False)

    def refused() -> bool:
        shown = container.show("vllm-supervisor.service", "ActiveState", "ExecMainStatus")
        return shown["ActiveState"] == "failed" and shown["ExecMainStatus"] == "2"

    wait_for(refused, timeout=30, what="the supervisor to refuse its config")
    # Exit 2 is not restarted: the daemon does not crash-loop on a config it cannot read.
    assert container.show("vllm-supervisor.service", "NRestarts")["NRestarts"] == "0"
    assert not supervisor_events(container, "following_journal")[1:]

    container.systemctl("start", UNIT)
    wait_for(lambda: running(container), timeout=30, what="the served unit to run")
    assert condition_skips(container) == 0
    gate_lines = [
        str(e.get("MESSAGE"))
        for e in container.journal("-u", UNIT)
        if "does not load" in str(e.get("MESSAGE"))
    ]
    assert gate_lines, "the gate must say in the unit's journal why nothing supervises it"


def test_a_person_killing_the_server_three_times_is_no_crash_loop(container: Container) -> None:
    """Was: `systemctl kill -s KILL` 10 s after each start, 3 times (PID 1 logs "Sent signal
    SIGKILL ... on client request"), made 3 unknown crashes and a halt on the 3rd. A kill a
    person (or a tool) asked for ends the run as a stop: observed, never counted, no halt."""
    start_supervisor(container)
    install_serving_unit(container)
    container.write_file(
        f"/etc/systemd/system/{UNIT}.d/50-e2e-restartsec.conf", "[Service]\nRestartSec=100ms\n"
    )
    container.systemctl("daemon-reload")
    container.systemctl("start", UNIT)
    for kill in range(1, 4):
        wait_for(lambda: running(container), timeout=30, what="the served unit to run")
        pid = container.show(UNIT, "MainPID")["MainPID"]
        container.systemctl("kill", "-s", "KILL", UNIT)
        wait_for(
            lambda killed=pid: container.show(UNIT, "MainPID")["MainPID"] not in ("0", killed),
            timeout=30,
            what=f"systemd to restart the server after kill {kill}",
        )
    wait_for(
        lambda: len([i for i in history(container) if i["ending"] == "stopped"]) >= 3,
        timeout=30,
        what="three kills recorded",
    )
    killed = [i for i in history(container) if i["ending"] == "stopped"]
    assert {i["decision"]["action"] for i in killed} == {"observe"}, killed
    assert not quarantined(container)
    wait_for(lambda: running(container), timeout=30, what="the served unit to run on")
