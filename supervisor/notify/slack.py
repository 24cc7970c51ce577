"""Slack as an edge-triggered sink: one Block Kit message per crash (supervisor.notify.message)
posted to an incoming webhook (supervisor.notify.webhook).

The webhook may be absent (Slack off: crashes are not queued for it), unusable (one error line
naming where the URL came from, never the URL; its messages wait for a fixed URL) or replaced at
a reload (supervisor.notify.webhook_reload), which `use` applies.
"""

from __future__ import annotations

from typing import Any

import structlog

from ..config import Config, SlackConfig, resolve_webhook, webhook_source
from ..errors import NotifyError
from ..telemetry.http import SinkState
from .message import as_repeat, build_payload
from .sink import DELIVERED, Crash, Mode, Pacing, Result, failed
from .webhook import SlackRateLimited, SlackWebhook

NAME = "slack"

_log = structlog.get_logger(__name__)


def pacing(config: SlackConfig) -> Pacing:
    """The outbox's timing for Slack, from `[slack]`."""
    return Pacing(
        min_interval_s=config.min_interval_s,
        timeout_s=config.timeout_s,
        max_attempts=config.max_attempts,
        backoff_max_s=config.backoff_max_s,
        group_interval_s=config.group_interval_s,
        backlog_hold_s=config.backlog_hold_s,
        notify_transient=config.notify_transient,
    )


class SlackSink:
    """Renders crashes as Slack messages and posts them to the current webhook."""

    mode = Mode.EDGE

    def __init__(
        self, webhook: SlackWebhook | None, config: SlackConfig, *, name: str = NAME
    ) -> None:
        self._config = config
        self._name = name
        self.pacing = pacing(config)
        self.webhook: SlackWebhook | None = None
        self.use(webhook)

    @property
    def name(self) -> str:
        """The `sink` label and the prefix of its log events."""
        return self._name

    def use(self, webhook: SlackWebhook | None) -> None:
        """Post to `webhook` from now on; None turns Slack off. An unusable one says so once."""
        self.webhook = webhook
        if webhook is not None and webhook.problem is not None:
            _log.error(
                "slack_webhook_invalid",
                source=webhook_source(self._config),
                problem=webhook.problem,
                action="Slack is off: crashes are still halted and recorded, their messages "
                "wait; fix the URL (vllm-supervisor check-config) and reload",
            )

    def state(self) -> SinkState:
        """Off without a URL; invalid_url (where it came from, never the URL) when unusable."""
        if self.webhook is None:
            return SinkState("off", "no webhook URL configured")
        if self.webhook.problem is not None:
            source = webhook_source(self._config)
            return SinkState(
                "invalid_url",
                f"slack webhook URL from {source} unusable ({self.webhook.problem}): Slack is off",
            )
        return SinkState("on")

    def render(self, subject: Crash) -> Any:
        """The Block Kit message of one crash, or of its group."""
        return build_payload(subject.outcome, host=subject.host, group=subject.group)

    def resent(self, payload: Any) -> Any:
        """Marked at its top: a webhook has no idempotency key, so Slack may show it twice."""
        return as_repeat(payload)

    async def send(self, payload: Any, *, timeout_s: float) -> Result:
        """One POST, classified by SlackWebhook (Retrier.Check); Retry-After kept."""
        if self.webhook is None:
            return failed(NotifyError("slack: off", reason="invalid_url", retryable=False))
        try:
            await self.webhook.send(payload, timeout_s=timeout_s)
        except SlackRateLimited as exc:
            return failed(exc, retry_after=exc.retry_after)
        except NotifyError as exc:
            return failed(exc)
        return DELIVERED

    async def aclose(self) -> None:
        """Close the webhook's connections."""
        if self.webhook is not None:
            await self.webhook.aclose()


def build_sink(config: Config) -> SlackSink:
    """The Slack sink for `config` (off when no URL is configured anywhere)."""
    url = resolve_webhook(config.slack)
    webhook = SlackWebhook(url, timeout_s=config.slack.timeout_s) if url else None
    return SlackSink(webhook, config.slack)
