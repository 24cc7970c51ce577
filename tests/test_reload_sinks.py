"""A reload (SIGHUP) says what it did not apply of the sinks: a webhook URL that changed since
the start is named in `not_reloaded`, never shown, and a restart applies it.

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
from faults.harness import Supervisor, write_config
from hypothesis import given, settings
from hypothesis import strategies as st
from slack_server import SECRET, SlackServer

from vllm_supervisor.config import WEBHOOK_CREDENTIAL, Config, Secret, SlackConfig
from vllm_supervisor.notify.webhook_reload import WebhookReload


def reloaded(sup: Supervisor, count: int) -> list[list[str]]:
    """`not_reloaded` of each `config_reloaded` line so far, once there are `count` of them."""
    events = [e for e in sup.events() if e["event"] == "config_reloaded"]
    return [e["not_reloaded"] for e in events] if len(events) >= count else []


def test_a_rewritten_webhook_file_is_named_by_the_reload(tmp_path: Path) -> None:
    """Slack off at the start (an empty webhook file); the URL written and SIGHUP sent: the
    reload names the webhook and its file, not the URL; a reload with nothing new names
    nothing."""
    hook = tmp_path / "slack-webhook"
    hook.write_text("", encoding="utf-8")
    config = write_config(tmp_path, extra=f'[slack]\nwebhook_url_file = "{hook}"\n')
    sup = Supervisor(tmp_path, config)
    slack = SlackServer()
    slack.start()
    try:
        sup.start()
        wait_for(sup.following, timeout=30, what="the daemon following")
        sup.process.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
        wait_for(lambda: reloaded(sup, 1), timeout=30, what="the first reload")
        hook.write_text(slack.url + "\n", encoding="utf-8")
        sup.process.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
        wait_for(lambda: reloaded(sup, 2), timeout=30, what="the second reload")
    finally:
        sup.stop_quietly()
        slack.stop()
    first, second = reloaded(sup, 2)
    assert first == []
    assert second == [f"slack webhook (slack.webhook_url_file {hook}, changed)"]
    assert SECRET not in sup.stderr_text()


def test_a_credential_written_after_the_start_is_named(tmp_path: Path) -> None:
    """systemd copied the credential at the start and does not at a reload: a source written
    after the copy is named (with the fix), one written before is not."""
    copy_dir = tmp_path / "credentials" / "vllm-supervisor.service"
    copy_dir.mkdir(parents=True)
    copy, source = copy_dir / WEBHOOK_CREDENTIAL, tmp_path / "etc-slack-webhook"
    copy.write_text("", encoding="utf-8")
    source.write_text("https://hooks.example/services/T/B/XXsecretXX\n", encoding="utf-8")
    asked: list[tuple[str, str]] = []

    async def systemd_says(unit: str, credential: str) -> str | None:
        asked.append((unit, credential))
        return str(source)

    watch = WebhookReload(
        None,
        credential_source=systemd_says,
        environ={"CREDENTIALS_DIRECTORY": str(copy_dir)},
    )
    copied_at = copy.stat().st_mtime_ns
    os.utime(source, ns=(copied_at - 10**9, copied_at - 10**9))  # written before the start
    assert _run(watch.not_reloaded(Config())) == []
    os.utime(source, ns=(copied_at + 10**9, copied_at + 10**9))  # written after it
    (named,) = _run(watch.not_reloaded(Config()))
    assert str(source) in named and "at start only" in named
    assert "XXsecretXX" not in named
    assert asked == [("vllm-supervisor.service", WEBHOOK_CREDENTIAL)] * 2


def test_a_credential_systemd_cannot_be_asked_about_is_named(tmp_path: Path) -> None:
    """No bus to ask where the credential comes from: the reload still says that a credential
    is applied at a restart only, instead of nothing."""
    copy_dir = tmp_path / "vllm-supervisor.service"
    copy_dir.mkdir()
    (copy_dir / WEBHOOK_CREDENTIAL).write_text("", encoding="utf-8")

    async def no_bus(unit: str, credential: str) -> str | None:
        raise OSError("no system bus")

    watch = WebhookReload(
        None, credential_source=no_bus, environ={"CREDENTIALS_DIRECTORY": str(copy_dir)}
    )
    (named,) = _run(watch.not_reloaded(Config()))
    assert "at start only" in named and "no system bus" in named


RUNNING = "https://hooks.example/services/T0/B0/running"


@settings(max_examples=60, deadline=None)
@given(url=st.text(min_size=1, max_size=80).filter(lambda s: s.strip() == s != RUNNING))
def test_the_name_of_a_changed_webhook_is_its_file_whatever_it_holds(
    tmp_path_factory: pytest.TempPathFactory, url: str
) -> None:
    """Whatever the webhook file holds now (a URL, garbage), the reload names the file and
    nothing of its content; the same URL as the running one is no change."""
    hook = tmp_path_factory.mktemp("hook") / "slack-webhook"
    hook.write_text(url, encoding="utf-8")
    config = Config(slack=SlackConfig(webhook_url_file=hook))
    changed = _run(WebhookReload(Secret(RUNNING), environ={}).not_reloaded(config))
    assert changed == [f"slack webhook (slack.webhook_url_file {hook}, changed)"]
    assert _run(WebhookReload(Secret(url), environ={}).not_reloaded(config)) == []


def _run(coro: Coroutine[Any, Any, list[str]]) -> list[str]:
    return asyncio.run(coro)
