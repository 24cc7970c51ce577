"""`status` shows each sink as the running daemon's /healthz has it: Slack on, off or with an
unusable URL, Alertmanager on or off, each with its last error, and what a reload left for a
restart; never a webhook URL.

Was: `status` had no line for Slack or Alertmanager, so a Slack that looked configured but was
off (or failing) showed nothing.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for
from faults.harness import Supervisor, crash, write_config
from slack_server import SECRET, Reply, SlackServer

from vllm_supervisor.journal.writer import JournalWriter


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def status(config: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "vllm_supervisor", "status", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.stdout + done.stderr


def health(config: Path) -> dict[str, Any]:
    """/healthz as `status --format json` reports it."""
    return dict(json.loads(status(config, "--format", "json"))["daemon"]["health"])


@pytest.fixture
def slack() -> Iterator[SlackServer]:
    server = SlackServer()
    server.start()
    yield server
    server.stop()


def start(tmp_path: Path, extra: str, *, slack_url: str | None = None) -> Supervisor:
    config = write_config(tmp_path, extra=extra, slack_url=slack_url)
    text = config.read_text(encoding="utf-8")
    config.write_text(text.replace('"127.0.0.1:0"', f'"127.0.0.1:{free_port()}"'))
    sup = Supervisor(tmp_path, config, env={"DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/no/bus"})
    sup.start()
    return sup


def test_failing_sinks_show_their_last_errors(tmp_path: Path, slack: SlackServer) -> None:
    """Slack answers 500, Alertmanager is not listening: both are on, each with its error;
    the webhook URL and its secret appear nowhere."""
    slack.reply(*[Reply(status=500, body="slack is down")] * 50)
    dead = f"http://127.0.0.1:{free_port()}"
    extra = f'[alertmanager]\nurl = "{dead}"\nresend_s = 1.0\nbackoff_max_s = 0.5\n'
    with JournalWriter(tmp_path / "journal") as writer:
        writer.write(crash("fatal", 1))
        sup = start(tmp_path, extra, slack_url=slack.url)
        try:
            wait_for(lambda: slack.count() >= 3, timeout=60, what="Slack failing three times")
            sinks = health(sup.config)["sinks"]
            text = status(sup.config)
        finally:
            sup.stop_quietly()
    assert sinks["slack"]["state"] == "on"
    assert "HTTP 500" in sinks["slack"]["last_error"]
    assert sinks["alertmanager"]["state"] == "on"
    assert "Connect" in sinks["alertmanager"]["last_error"]
    assert "    slack:     on; last error: slack: HTTP 500" in text
    assert "    alertmanager: on; last error: " in text
    assert SECRET not in text and SECRET not in json.dumps(sinks)


def test_sinks_off_a_reload_turning_slack_on_and_a_key_waiting(
    tmp_path: Path, slack: SlackServer
) -> None:
    """No webhook, no Alertmanager: both off. The webhook written into its file and
    alertmanager.url set, then SIGHUP: Slack is on, and status says that a restart applies
    alertmanager.url."""
    hook = tmp_path / "slack-webhook"
    hook.write_text("", encoding="utf-8")
    sup = start(tmp_path, f'[slack]\nwebhook_url_file = "{hook}"\n')
    try:
        wait_for(sup.following, timeout=30, what="the daemon following")
        before = status(sup.config)
        hook.write_text(slack.url, encoding="utf-8")
        text = sup.config.read_text(encoding="utf-8")
        sup.config.write_text(text + '[alertmanager]\nurl = "http://127.0.0.1:9"\n')
        sup.process.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
        wait_for(lambda: health(sup.config).get("not_reloaded"), timeout=30, what="the reload seen")
        after = status(sup.config)
    finally:
        sup.stop_quietly()
    assert "    slack:     off (no webhook URL configured)" in before
    assert "    alertmanager: off (no alertmanager.url)" in before
    assert "restart:" not in before
    assert "    slack:     on\n" in after
    assert "    alertmanager: off (no alertmanager.url)" in after
    assert "    restart:   to apply alertmanager.url\n" in after
    assert SECRET not in after


def test_an_unusable_webhook_url_is_said_without_the_url(tmp_path: Path) -> None:
    """A webhook URL httpx cannot use (here from its file) turns Slack off: status says why,
    never what the URL was."""
    hook = tmp_path / "slack-webhook"
    hook.write_text("https://hooks.example/services/T0/B0/XXunusable SECRETxx", encoding="utf-8")
    sup = start(tmp_path, f'[slack]\nwebhook_url_file = "{hook}"\n')
    try:
        wait_for(sup.following, timeout=30, what="the daemon following")
        text = status(sup.config)
    finally:
        sup.stop_quietly()
    assert "    slack:     INVALID URL (" in text
    assert "XXunusable" not in text and "SECRETxx" not in text
