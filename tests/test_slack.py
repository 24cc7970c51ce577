"""Slack: the payload, one webhook attempt, and outbox delivery against a real server."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import structlog
from conftest import poll
from notify_fakes import FakeClock, make_outcome, running, slack_outbox
from slack_server import SECRET, Reply, SlackServer

from vllm_supervisor.config import Secret, SlackConfig
from vllm_supervisor.errors import NotifyError
from vllm_supervisor.model import Action, Severity, Taken
from vllm_supervisor.notify.decision import Group
from vllm_supervisor.notify.message import (
    FIELD_LIMIT,
    HEADER_LIMIT,
    SECTION_LIMIT,
    TRUNCATED,
    build_payload,
)
from vllm_supervisor.notify.outbox import Outbox
from vllm_supervisor.notify.webhook import SlackRateLimited, SlackWebhook
from vllm_supervisor.store import Checkpoint, Store
from vllm_supervisor.story import told
from vllm_supervisor.telemetry.metrics import Metrics, new_registry


def _texts(payload: dict) -> list[str]:
    """Every text of a payload: the fallback, section texts, fields and context elements."""
    texts = [payload["text"]]
    for block in payload["blocks"]:
        if "text" in block:
            texts.append(block["text"]["text"])
        texts.extend(f["text"] for f in block.get("fields", []))
        texts.extend(e["text"] for e in block.get("elements", []))
    return texts


class TestPayload:
    """build_payload renders an Outcome into Block Kit with a plain-text fallback."""

    def test_shape_of_a_halt(self) -> None:
        """A halt names host, unit, title, cause, crash site, remediation, restarts, release."""
        payload = build_payload(make_outcome(), host="gpu-7")
        kinds = [b["type"] for b in payload["blocks"]]
        assert kinds[0] == "header"
        assert set(kinds) <= {"header", "section", "context"}
        everything = "\n".join(_texts(payload))
        for expected in (
            "gpu-7",
            "vllm.service",
            "flashinfer cubin mismatch",
            "RuntimeError: flashinfer-cubin version (0.6.3)",
            "deepseek_v2.py, line 998",
            "Install matching flashinfer-python",
            "*Restarts*\n3",
            "vllm-supervisor release vllm.service",
        ):
            assert expected in everything
        assert "vllm-supervisor release vllm.service" in payload["text"]

    def test_crash_site_only_when_it_differs(self) -> None:
        """A crash site already contained in the root-cause line is not repeated."""
        outcome = make_outcome(root_cause="boom in deepseek_v2.py, line 998, in __init__")
        payload = build_payload(outcome, host="h")
        assert not any("*Crash site*" in t for t in _texts(payload))

    def test_dry_run_says_no_action(self) -> None:
        """In dry-run the action says nothing was done and offers no release command."""
        payload = build_payload(make_outcome(dry_run=True), host="h")
        assert any(told("halt", "dry-run") in t for t in _texts(payload))
        assert "release" not in json.dumps(payload)

    def test_each_thing_done_has_its_line(self) -> None:
        """Every Taken renders its own action line; only a halt offers the release, and a held
        start the same command to start it now (tests/test_hold_message.py)."""
        for taken in Taken:
            payload = build_payload(make_outcome(taken=taken), host="h")
            offers_release = "vllm-supervisor release" in payload["text"]
            expected = taken in (Taken.HALTED, Taken.QUARANTINED, Taken.HELD)
            assert offers_release == expected, taken

    def test_group_count_per_interval(self) -> None:
        """A group of transient crashes shows its count and interval."""
        outcome = make_outcome(severity=Severity.TRANSIENT, action=Action.ALLOW_RESTART)
        group = Group(count=4, first=0.0, last=540.0, interval_s=600.0)
        payload = build_payload(outcome, host="h", group=group)
        assert "4 crashes of this kind between 00:00 and 00:09 UTC (grouped per 10 min)" in (
            "\n".join(_texts(payload))
        )

    def test_log_text_cannot_mention_or_link(self) -> None:
        """`& < >` from the journal are escaped, so `<!channel>` never reaches Slack unescaped."""
        outcome = make_outcome(
            root_cause="Error <!channel> <@U123> <https://evil|click> a&b",
            crash_site="<!here>",
            remediation="run `x > y`",
        )
        payload = build_payload(outcome, host="<!everyone>")
        dumped = json.dumps(payload)
        assert "<!" not in dumped
        assert "<@" not in dumped
        assert "<https" not in dumped
        assert "&lt;!channel&gt;" in payload["text"]
        assert "a&amp;b" in payload["text"]

    def test_every_section_within_limits(self) -> None:
        """Huge lines are cut with a marker so each block stays within Slack's limits."""
        huge = "x&" * 5000
        outcome = make_outcome(root_cause=huge, crash_site="y" * 9000, remediation="z" * 9000)
        payload = build_payload(outcome, host="h" * 3000)
        assert_within_limits(payload)
        assert len(payload["text"]) <= SECTION_LIMIT
        assert any(t.endswith(TRUNCATED) for t in _texts(payload))
        for text in _texts(payload):
            cut = text.removesuffix(TRUNCATED)
            assert not cut.endswith(("&", "&a", "&am", "&amp"))  # no entity cut in half

    def test_unknown_crash_shows_fingerprint(self) -> None:
        """A crash no signature knows is reported with its fingerprint."""
        outcome = make_outcome(signature=None, severity=Severity.UNKNOWN)
        assert "fp-1234abcd" in json.dumps(build_payload(outcome, host="h"))


class TestWebhook:
    """One attempt against a real HTTP server on loopback, classified like Alertmanager."""

    async def test_2xx_is_delivered(self, slack: SlackServer) -> None:
        """A 200 returns normally and the server received the JSON payload on the secret path."""
        async with SlackWebhook(Secret(slack.url), timeout_s=5) as hook:
            await hook.send({"text": "hi"})
        assert slack.requests[0].json() == {"text": "hi"}
        assert slack.requests[0].path.endswith(SECRET)
        assert slack.requests[0].headers["Content-Type"] == "application/json"

    async def test_5xx_is_retryable(self, slack: SlackServer) -> None:
        """A 500 raises a retryable NotifyError."""
        slack.reply(Reply(500, "oops"))
        async with SlackWebhook(Secret(slack.url)) as hook:
            with pytest.raises(NotifyError) as caught:
                await hook.send({"text": "hi"})
        assert (caught.value.retryable, caught.value.reason) == (True, "http_5xx")

    async def test_429_exposes_retry_after(self, slack: SlackServer) -> None:
        """A 429 is retryable and carries Retry-After in seconds."""
        slack.reply(Reply(429, "rate_limited", {"Retry-After": "7"}))
        async with SlackWebhook(Secret(slack.url)) as hook:
            with pytest.raises(SlackRateLimited) as caught:
                await hook.send({"text": "hi"})
        assert caught.value.retryable
        assert caught.value.retry_after == 7.0

    async def test_4xx_is_permanent_with_slack_text(self, slack: SlackServer) -> None:
        """A 400 invalid_payload is permanent; the reason and message carry Slack's error text."""
        slack.reply(Reply(400, "invalid_payload"))
        async with SlackWebhook(Secret(slack.url)) as hook:
            with pytest.raises(NotifyError) as caught:
                await hook.send({"text": "hi"})
        assert (caught.value.retryable, caught.value.reason) == (False, "invalid_payload")
        assert "invalid_payload" in str(caught.value)

    async def test_error_text_is_bounded(self, slack: SlackServer) -> None:
        """An unexpected long 4xx body is cut and becomes the bounded reason http_4xx."""
        slack.reply(Reply(404, "no such thing " * 500))
        async with SlackWebhook(Secret(slack.url)) as hook:
            with pytest.raises(NotifyError) as caught:
                await hook.send({"text": "hi"})
        assert caught.value.reason == "http_4xx"
        assert len(str(caught.value)) < 300

    async def test_connection_refused_is_retryable(self, slack: SlackServer) -> None:
        """Slack being unreachable is a retryable transport error."""
        slack.stop()
        async with SlackWebhook(Secret(slack.url)) as hook:
            with pytest.raises(NotifyError) as caught:
                await hook.send({"text": "hi"})
        assert (caught.value.retryable, caught.value.reason) == (True, "connect")

    async def test_tls_error_is_retryable(self, slack: SlackServer) -> None:
        """A TLS handshake failure (https to a plain-HTTP port) is a retryable "tls" error."""
        url = slack.url.replace("http://", "https://")
        async with SlackWebhook(Secret(url)) as hook:
            with pytest.raises(NotifyError) as caught:
                await hook.send({"text": "hi"})
        assert (caught.value.retryable, caught.value.reason) == (True, "tls")
        assert SECRET not in str(caught.value)

    async def test_url_never_leaks(
        self, slack: SlackServer, caplog: pytest.LogCaptureFixture
    ) -> None:
        """The secret is absent from errors, their chain, the repr and httpx's own request log."""
        caplog.set_level(logging.DEBUG)
        slack.reply(Reply(500, f"echo {slack.url}"), Reply(400, f"bad {SECRET}"))
        hook = SlackWebhook(Secret(slack.url))
        errors = []
        for _ in range(2):
            with pytest.raises(NotifyError) as caught:
                await hook.send({"text": "hi"})
            errors.append(caught.value)
        slack.stop()
        with pytest.raises(NotifyError) as caught:
            await hook.send({"text": "hi"})
        errors.append(caught.value)
        await hook.aclose()
        for error in errors:
            assert SECRET not in str(error)
            assert SECRET not in repr(error)
            assert error.__cause__ is None
        assert SECRET not in repr(hook)
        assert "HTTP Request" in caplog.text  # httpx did log the requests, redacted
        assert SECRET not in caplog.text


def _outbox(
    path: Path, url: str, clock: FakeClock, registry_metrics: Metrics, **config: float
) -> tuple[Store, Outbox]:
    store = Store(path)
    slack = SlackConfig(**config)  # type: ignore[arg-type]
    hook = SlackWebhook(Secret(url), timeout_s=5)
    outbox = slack_outbox(
        store, hook, registry_metrics, slack, host="gpu-7", now=clock.now, sleep=clock.sleep
    )
    return store, outbox


def _queue(store: Store, outbox: Outbox, outcome=None, cursor: str = "c1") -> None:
    outcome = outcome or make_outcome()
    store.commit_batch(
        checkpoint=Checkpoint(cursor=cursor),
        outcomes=[outcome],
        extra=[outbox.writer_for(outcome)],
    )


def _count(metrics: Metrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value(
        "vllm_supervisor_notifications_total", {"sink": "slack", "outcome": outcome}
    )
    return value or 0.0


class TestDelivery:
    """The outbox delivering to a real HTTP server, with time injected."""

    async def test_500_then_200_is_sent_once(self, slack: SlackServer, tmp_path: Path) -> None:
        """A 500 is retried; the 200 that follows delivers it, and no further request is made."""
        slack.reply(Reply(500, "oops"))
        clock, metrics = FakeClock(), Metrics(new_registry(process=False))
        store, outbox = _outbox(tmp_path / "s.db", slack.url, clock, metrics)
        _queue(store, outbox)
        async with running(outbox):
            await poll(lambda: store.history()[0]["notified"])
        assert slack.count() == 2
        assert slack.requests[0].json() == slack.requests[1].json()
        assert (_count(metrics, "retried"), _count(metrics, "sent")) == (1.0, 1.0)
        assert outbox.depth() == 0

    async def test_429_waits_for_retry_after(self, slack: SlackServer, tmp_path: Path) -> None:
        """A 429 with Retry-After: 30 delays the next attempt by 30 s, then it is sent once."""
        slack.reply(Reply(429, "rate_limited", {"Retry-After": "30"}))
        clock, metrics = FakeClock(), Metrics(new_registry(process=False))
        store, outbox = _outbox(tmp_path / "s.db", slack.url, clock, metrics)
        _queue(store, outbox)
        async with running(outbox):
            await poll(lambda: store.history()[0]["notified"])
        assert slack.count() == 2
        assert sum(clock.slept) >= 30.0
        assert _count(metrics, "sent") == 1.0

    async def test_400_is_not_retried(self, slack: SlackServer, tmp_path: Path) -> None:
        """A 400 invalid_payload marks the message failed after one request and counts it."""
        slack.reply(Reply(400, "invalid_payload"))
        clock, metrics = FakeClock(), Metrics(new_registry(process=False))
        store, outbox = _outbox(tmp_path / "s.db", slack.url, clock, metrics)
        _queue(store, outbox)
        with structlog.testing.capture_logs() as logs:
            async with running(outbox):
                await poll(lambda: _count(metrics, "failed") == 1.0)
                assert outbox.depth() == 0
        assert slack.count() == 1
        assert not store.history()[0]["notified"]
        assert [e["event"] for e in logs if e["log_level"] == "error"] == ["slack_message_dropped"]
        assert "invalid_payload" in logs[-1]["error"]

    async def test_survives_supervisor_restart(self, slack: SlackServer, tmp_path: Path) -> None:
        """Slack down at the crash, supervisor restarted, Slack back: the message arrives once."""
        db, url = tmp_path / "state.db", slack.url
        slack.stop()
        clock = FakeClock()
        metrics = Metrics(new_registry(process=False))
        store, outbox = _outbox(db, url, clock, metrics, max_attempts=1000)
        _queue(store, outbox)
        with structlog.testing.capture_logs() as logs:
            async with running(outbox):
                await poll(lambda: _count(metrics, "retried") >= 2)
        store.close()
        slack.start()  # the same port
        metrics2 = Metrics(new_registry(process=False))
        store2, outbox2 = _outbox(db, url, clock, metrics2, max_attempts=1000)
        assert outbox2.depth() == 1
        async with running(outbox2):
            await poll(lambda: store2.history()[0]["notified"])
        store2.close()
        store3, outbox3 = _outbox(db, url, clock, Metrics(new_registry(process=False)))
        async with running(outbox3):
            assert outbox3.depth() == 0
        assert slack.count() == 1
        failures = [e for e in logs if e["event"] == "slack_delivery_failed"]
        assert len(failures) == 1  # the identical connection error is logged once
        assert SECRET not in repr(logs)
        store3.close()

    async def test_secret_not_in_logs(self, slack: SlackServer, tmp_path: Path) -> None:
        """No captured structlog event mentions the webhook secret, whatever failed."""
        slack.reply(Reply(500, slack.url), Reply(429, SECRET), Reply(403, slack.url))
        clock, metrics = FakeClock(), Metrics(new_registry(process=False))
        store, outbox = _outbox(tmp_path / "s.db", slack.url, clock, metrics)
        _queue(store, outbox)
        with structlog.testing.capture_logs() as logs:
            async with running(outbox):
                await poll(lambda: _count(metrics, "failed") == 1.0)
        assert logs
        assert SECRET not in repr(logs)
        assert SECRET not in repr(outbox.health())


def assert_within_limits(payload: dict[str, Any]) -> None:
    """Every block of `payload` within Slack's limits (a header, a section, a field)."""
    for block in payload["blocks"]:
        if block["type"] == "header":
            assert len(block["text"]["text"]) <= HEADER_LIMIT
        elif "text" in block:
            assert len(block["text"]["text"]) <= SECTION_LIMIT
        for item in block.get("fields", []):
            assert len(item["text"]) <= FIELD_LIMIT
