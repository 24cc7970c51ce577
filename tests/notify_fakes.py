"""Builders and fakes shared by the notify, outbox and metrics tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from vllm_supervisor.config import SlackConfig
from vllm_supervisor.model import (
    Action,
    Decision,
    Invocation,
    LogLine,
    Outcome,
    Severity,
    Taken,
    Verdict,
)
from vllm_supervisor.notify.outbox import Outbox
from vllm_supervisor.notify.slack import SlackSink
from vllm_supervisor.notify.webhook import SlackWebhook
from vllm_supervisor.store import Store
from vllm_supervisor.telemetry.metrics import Metrics

T0 = 1_800_000_000.0


def make_outcome(
    *,
    unit: str | None = "vllm.service",
    invocation_id: str | None = "inv-1",
    signature: str | None = "flashinfer_cubin_mismatch",
    severity: Severity = Severity.FATAL,
    action: Action = Action.HALT,
    dry_run: bool = False,
    root_cause: str = "RuntimeError: flashinfer-cubin version (0.6.3) does not match (0.6.4)",
    crash_site: str | None = "deepseek_v2.py, line 998, in __init__",
    remediation: str | None = "Install matching flashinfer-python and flashinfer-cubin.",
    restarts: int | None = 3,
    ended_s: float = T0,
    exit_status: int = 1,
    taken: Taken | None = None,
) -> Outcome:
    """A crashed invocation with its verdict, decision and what was done (by default, what
    the decision says when carried out)."""
    invocation = Invocation(
        unit=unit,
        invocation_id=invocation_id,
        lines=(LogLine(text=root_cause),),
        total_lines=812,
        exit_code="exited",
        exit_status=exit_status,
        result="exit-code" if exit_status else "success",
        restarts=restarts,
        ended_us=int(ended_s * 1_000_000),
        last_cursor=f"cursor-{invocation_id}",
    )
    verdict = Verdict(
        signature=signature,
        severity=severity,
        title="flashinfer cubin mismatch" if signature else "Unknown crash",
        root_cause=root_cause,
        crash_site=crash_site,
        remediation=remediation,
        fingerprint=None if signature else "fp-1234abcd",
        crashed=bool(exit_status),
    )
    if taken is None:
        taken = {
            Action.HALT: Taken.WOULD_HALT if dry_run else Taken.HALTED,
            Action.ALLOW_RESTART: Taken.RESTARTING,
            Action.OBSERVE: Taken.OBSERVED,
        }[action]
    return Outcome(
        invocation=invocation,
        verdict=verdict,
        decision=Decision(action=action, reason="fatal signature", dry_run=dry_run),
        taken=taken,
    )


def slack_outbox(
    store: Store,
    webhook: SlackWebhook | None,
    metrics: Metrics,
    config: SlackConfig,
    *,
    host: str,
    **timing: Any,
) -> Outbox:
    """The outbox lane of a Slack sink posting to `webhook` (None: Slack off)."""
    return Outbox(store, SlackSink(webhook, config), metrics, host=host, **timing)


class FakeClock:
    """Wall-clock stand-in: `sleep` advances time at once instead of waiting."""

    def __init__(self, start: float = T0) -> None:
        self.t = start
        self.slept: list[float] = []

    def now(self) -> float:
        """The current fake time."""
        return self.t

    async def sleep(self, seconds: float) -> None:
        """Advance the clock by `seconds` and yield to the event loop once."""
        self.slept.append(seconds)
        self.t += seconds
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def running(outbox: Outbox) -> AsyncIterator[asyncio.Event]:
    """Run `outbox.run` as a task for the block; stop it and wait for it afterwards."""
    stop = asyncio.Event()
    task = asyncio.create_task(outbox.run(stop))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, timeout=15)
