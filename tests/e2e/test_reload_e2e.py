"""A webhook written into the shipped credential file and `systemctl reload` (real systemd 252
in nspawn): Slack turns on without a restart, `status` says so, and the next halt reaches it.

Was: the reload logged `not_reloaded: []` and Slack stayed off, with nothing saying why: the
daemon read the URL at its start only. (For the shipped unit systemd 252 writes the credential's
copy again for `ExecReload=`, so the daemon reads the new URL at the SIGHUP.)
"""

from __future__ import annotations

import socket

import pytest
from nspawn import Container, wait_for
from served import (
    SEED_LOG,
    SUPERVISOR_CONFIG,
    UNIT,
    container,
    install_served_unit,
    start_supervisor,
    supervisor_events,
)
from slack_server import SECRET, SlackServer

pytestmark = pytest.mark.nspawn
__all__ = ["container"]  # the fixture, used by name

SUPERVISOR = "vllm-supervisor.service"
CREDENTIAL = "/etc/vllm-supervisor/slack-webhook"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def status(box: Container) -> str:
    return box.run("vllm-supervisor", "status", check=False).stdout


def test_a_webhook_written_and_reloaded_turns_slack_on(container: Container) -> None:
    slack = SlackServer()  # on the host's loopback, which the container shares
    slack.start()
    try:
        # Its own metrics port: the host's loopback is shared with any other container.
        config = SUPERVISOR_CONFIG.replace("127.0.0.1:9464", f"127.0.0.1:{free_port()}")
        assert config != SUPERVISOR_CONFIG
        start_supervisor(container, config)  # with an empty credential: Slack off
        assert "    slack:     off (no webhook URL configured)" in status(container)
        daemon_pid = container.show(SUPERVISOR, "MainPID")["MainPID"]
        container.write_file(CREDENTIAL, slack.url + "\n", mode="0600")
        container.systemctl("reload", SUPERVISOR)
        wait_for(
            lambda: supervisor_events(container, "config_reloaded") or None,
            timeout=30,
            what="the reload logged",
        )
        (reloaded,) = supervisor_events(container, "config_reloaded")
        assert reloaded["not_reloaded"] == []
        (applied,) = supervisor_events(container, "slack_webhook_reloaded")
        assert applied["slack"] == "on" and applied["source"].startswith("credential ")
        shown = status(container)
        assert "    slack:     on" in shown and "restart:" not in shown
        assert container.show(SUPERVISOR, "MainPID")["MainPID"] == daemon_pid  # no restart

        install_served_unit(container, SEED_LOG, "100ms")
        container.systemctl("start", UNIT)
        wait_for(lambda: slack.count() >= 1, timeout=60, what="the halt's Slack message")
        assert "flashinfer" in slack.requests[0].body.decode()
        journal = container.run("journalctl", "--no-pager", "-o", "json", "-u", SUPERVISOR)
        assert SECRET not in journal.stdout + shown
    finally:
        slack.stop()
