"""A reload (SIGHUP) applies a webhook URL that changed since the start (Slack turns on), and
names what it cannot apply in `not_reloaded`: a credential systemd did not copy again, the
restart-only `[alertmanager]` keys. No URL is ever shown.

Was: writing the webhook into its file (or its systemd credential) and reloading left Slack off
while the reload logged `not_reloaded: []`.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for
from faults.harness import Supervisor, crash, write_config
from hypothesis import given, settings
from hypothesis import strategies as st
from slack_server import SECRET, SlackServer

from vllm_supervisor.config import WEBHOOK_CREDENTIAL, Config, Secret, SlackConfig
from vllm_supervisor.journal.writer import JournalWriter
from vllm_supervisor.notify.slack import SlackSink
from vllm_supervisor.notify.webhook import SlackWebhook
from vllm_supervisor.notify.webhook_reload import SlackReload
from vllm_supervisor.util.urls import url_problem


def reloaded(sup: Supervisor, count: int) -> list[list[str]]:
    """`not_reloaded` of each `config_reloaded` line so far, once there are `count` of them."""
    events = [e for e in sup.events() if e["event"] == "config_reloaded"]
    return [e["not_reloaded"] for e in events] if len(events) >= count else []


def test_a_webhook_written_and_reloaded_turns_slack_on(tmp_path: Path) -> None:
    """Slack off at the start (an empty webhook file); the URL written and SIGHUP sent: the
    reload applies it (nothing left for a restart), the next crash reaches Slack, and the log
    says where the URL came from, never the URL."""
    hook = tmp_path / "slack-webhook"
    hook.write_text("", encoding="utf-8")
    config = write_config(tmp_path, extra=f'[slack]\nwebhook_url_file = "{hook}"\n')
    sup = Supervisor(tmp_path, config)
    slack = SlackServer()
    slack.start()
    try:
        with JournalWriter(tmp_path / "journal") as writer:
            sup.start()
            wait_for(sup.following, timeout=30, what="the daemon following")
            hook.write_text(slack.url + "\n", encoding="utf-8")
            sup.process.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
            wait_for(lambda: reloaded(sup, 1), timeout=30, what="the reload")
            writer.write(crash("fatal", 1))
            wait_for(lambda: slack.count() >= 1, timeout=30, what="the crash's Slack message")
    finally:
        sup.stop_quietly()
        slack.stop()
    assert reloaded(sup, 1) == [[]]
    (applied,) = [e for e in sup.events() if e["event"] == "slack_webhook_reloaded"]
    assert (applied["source"], applied["slack"]) == (f"slack.webhook_url_file {hook}", "on")
    assert "flashinfer" in slack.requests[0].body.decode()
    assert SECRET not in sup.stderr_text()


def test_a_changed_alertmanager_url_is_named_for_a_restart(tmp_path: Path) -> None:
    """The [alertmanager] keys apply at a restart: a reload that changes one names it."""
    config = write_config(tmp_path)
    sup = Supervisor(tmp_path, config)
    try:
        sup.start()
        wait_for(sup.following, timeout=30, what="the daemon following")
        text = config.read_text(encoding="utf-8")
        config.write_text(text + '[alertmanager]\nurl = "http://127.0.0.1:9093"\n')
        sup.process.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
        wait_for(lambda: reloaded(sup, 1), timeout=30, what="the reload")
    finally:
        sup.stop_quietly()
    assert reloaded(sup, 1) == [["alertmanager.url"]]


def reload_with(tmp_path: Path, url: Secret | None, **kwargs: Any) -> SlackReload:
    sink = SlackSink(SlackWebhook(url, timeout_s=1.0) if url else None, SlackConfig())
    return SlackReload(sink, timeout_s=1.0, **kwargs)


def test_a_credential_written_after_the_start_is_named(tmp_path: Path) -> None:
    """A unit whose credential systemd copied at the start only: a source written after the
    copy is named (with the fix), one written before is not, and Slack stays as it was."""
    copy_dir = tmp_path / "credentials" / "vllm-supervisor.service"
    copy_dir.mkdir(parents=True)
    copy, source = copy_dir / WEBHOOK_CREDENTIAL, tmp_path / "etc-slack-webhook"
    copy.write_text("", encoding="utf-8")
    source.write_text("https://hooks.example/services/T/B/XXsecretXX\n", encoding="utf-8")
    asked: list[tuple[str, str]] = []

    async def systemd_says(unit: str, credential: str) -> str | None:
        asked.append((unit, credential))
        return str(source)

    slack = reload_with(
        tmp_path,
        None,
        credential_source=systemd_says,
        environ={"CREDENTIALS_DIRECTORY": str(copy_dir)},
    )
    copied_at = copy.stat().st_mtime_ns
    os.utime(source, ns=(copied_at - 10**9, copied_at - 10**9))  # written before the start
    assert _run(slack.reload(Config())) == []
    os.utime(source, ns=(copied_at + 10**9, copied_at + 10**9))  # written after it
    (named,) = _run(slack.reload(Config()))
    assert str(source) in named and "at start only" in named
    assert "XXsecretXX" not in named
    assert asked == [("vllm-supervisor.service", WEBHOOK_CREDENTIAL)] * 2
    assert slack.webhook is None


def test_a_credential_systemd_cannot_be_asked_about_is_named(tmp_path: Path) -> None:
    """No bus to ask where the credential comes from: the reload says that the credential may
    need a restart, instead of nothing."""
    copy_dir = tmp_path / "vllm-supervisor.service"
    copy_dir.mkdir()
    (copy_dir / WEBHOOK_CREDENTIAL).write_text("", encoding="utf-8")

    async def no_bus(unit: str, credential: str) -> str | None:
        raise OSError("no system bus")

    slack = reload_with(
        tmp_path, None, credential_source=no_bus, environ={"CREDENTIALS_DIRECTORY": str(copy_dir)}
    )
    (named,) = _run(slack.reload(Config()))
    assert "at start only" in named and "no system bus" in named


RUNNING = "https://hooks.example/services/T0/B0/running"


@settings(max_examples=40, deadline=None)
@given(url=st.text(min_size=1, max_size=80).filter(lambda s: s.strip() == s != RUNNING))
def test_whatever_the_webhook_file_holds_a_reload_applies_or_refuses_it(
    tmp_path_factory: pytest.TempPathFactory, url: str
) -> None:
    """Whatever the webhook file holds now (a URL, garbage), a reload takes it: Slack is on
    with it, or off with the URL's problem said; nothing is left for a restart."""
    hook = tmp_path_factory.mktemp("hook") / "slack-webhook"
    hook.write_text(url, encoding="utf-8")
    slack = reload_with(tmp_path_factory.mktemp("state"), Secret(RUNNING), environ={})
    config = Config(slack=SlackConfig(webhook_url_file=hook))
    assert _run(slack.reload(config)) == []
    assert slack.webhook is not None
    assert (slack.webhook.problem is None) == (url_problem(url) is None)
    assert _run(slack.reload(config)) == []
    _run(slack.webhook.aclose())


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coro)
