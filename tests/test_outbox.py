"""The outbox: atomic queueing, idempotence, grouping, pacing, backoff and giving up."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import structlog
from conftest import poll
from notify_fakes import T0, FakeClock, make_outcome, running, slack_outbox

from vllm_supervisor.config import Secret, SlackConfig
from vllm_supervisor.errors import StateError
from vllm_supervisor.model import Action, Outcome, Severity
from vllm_supervisor.notify.webhook import SlackWebhook
from vllm_supervisor.store import Checkpoint, Store
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

URL = Secret("https://hooks.example.invalid/services/T1/B1/tokentokentoken")


class Recorder:
    """An httpx transport handler that records payloads and answers with scripted statuses."""

    def __init__(self, statuses: tuple[int, ...] = ()) -> None:
        self.statuses = list(statuses)
        self.payloads: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        """Record the payload; answer the next scripted status (200 when none is left)."""
        self.payloads.append(json.loads(request.content))
        status = self.statuses.pop(0) if self.statuses else 200
        return httpx.Response(status, text="ok" if status == 200 else "server_error")


class Harness:
    """A store, an outbox with a recording transport, a fake clock and fresh metrics."""

    def __init__(self, path: Path, recorder: Recorder | None = None, **slack: float) -> None:
        self.clock = FakeClock()
        self.recorder = recorder or Recorder()
        self.metrics = Metrics(new_registry(process=False))
        self.store = Store(path / "state.db")
        transport = httpx.MockTransport(self.recorder)
        hook = SlackWebhook(URL, transport=transport)
        self.config = SlackConfig(**slack)  # type: ignore[arg-type]
        self.outbox = slack_outbox(
            self.store,
            hook,
            self.metrics,
            self.config,
            host="gpu-7",
            now=self.clock.now,
            sleep=self.clock.sleep,
        )

    def commit(self, *outcomes: Outcome, cursor: str = "c") -> None:
        """Commit one batch with the outcomes and their queued messages."""
        writers = [self.outbox.writer_for(o) for o in outcomes]
        self.store.commit_batch(
            checkpoint=Checkpoint(cursor=cursor), outcomes=outcomes, extra=writers
        )

    def count(self, outcome: str) -> float:
        """The notifications_total counter for one outcome."""
        value = self.metrics.registry.get_sample_value(
            "vllm_supervisor_notifications_total", {"sink": "slack", "outcome": outcome}
        )
        return value or 0.0

    def sent(self) -> Callable[[], int]:
        """A condition helper: how many payloads the transport received."""
        return lambda: len(self.recorder.payloads)


@pytest.fixture(name="h")
def _h(tmp_path: Path) -> Harness:
    return Harness(tmp_path)


def _transient(n: int, at: float) -> Outcome:
    return make_outcome(
        invocation_id=f"inv-{n}",
        signature="nccl_timeout",
        severity=Severity.TRANSIENT,
        action=Action.ALLOW_RESTART,
        ended_s=at,
    )


class TestQueueing:
    """writer_for queues inside the batch transaction, once per (unit, invocation id)."""

    def test_same_invocation_is_queued_once(self, h: Harness) -> None:
        """A replayed batch with the same invocation does not queue a second message."""
        h.commit(make_outcome())
        h.commit(make_outcome(), cursor="c2")
        assert h.outbox.depth() == 1
        assert h.count("queued") == 1

    def test_rolled_back_batch_queues_nothing(self, h: Harness) -> None:
        """When the batch's transaction fails, its message is not queued either."""
        outcome = make_outcome()

        def broken(db: object) -> None:
            raise RuntimeError("disk full")

        with pytest.raises(RuntimeError):
            h.store.commit_batch(
                checkpoint=Checkpoint(cursor="c"),
                outcomes=[outcome],
                extra=[h.outbox.writer_for(outcome), broken],
            )
        assert h.outbox.depth() == 0
        h.commit(outcome)  # the replay queues it
        assert h.outbox.depth() == 1

    def test_clean_exit_is_not_announced(self, h: Harness) -> None:
        """An invocation that neither failed nor shows a crash queues nothing."""
        h.commit(make_outcome(exit_status=0, action=Action.OBSERVE))
        assert h.outbox.depth() == 0

    def test_fatal_crashes_are_never_grouped(self, h: Harness) -> None:
        """Two fatal crashes of the same unit and signature are two messages."""
        h.commit(make_outcome(invocation_id="a"), make_outcome(invocation_id="b"))
        assert h.outbox.depth() == 2

    def test_transient_off_drops(self, tmp_path: Path) -> None:
        """With notify_transient off, transient crashes are counted as dropped, not queued."""
        h = Harness(tmp_path, notify_transient=False)
        h.commit(_transient(1, T0))
        assert (h.outbox.depth(), h.count("dropped")) == (0, 1)

    def test_no_webhook_queues_nothing(self, tmp_path: Path) -> None:
        """With Slack off, writers are no-ops and the outbox stays empty."""
        store = Store(tmp_path / "s.db")
        metrics = Metrics(new_registry(process=False))
        outbox = slack_outbox(store, None, metrics, SlackConfig(), host="h")
        outcome = make_outcome()
        writer = outbox.writer_for(outcome)
        store.commit_batch(checkpoint=Checkpoint(), outcomes=[outcome], extra=[writer])
        assert outbox.depth() == 0
        assert outbox.health() == (True, {"slack": "off", "reasons": []})


class TestGrouping:
    """Transient crashes of one unit+signature: the first at once, then one per interval."""

    async def test_one_message_per_interval_with_count(self, h: Harness) -> None:
        """The first crash is sent at once; the next three arrive as one message with count 3."""
        h.commit(_transient(1, T0))
        async with running(h.outbox):
            await poll(lambda: h.count("sent") == 1)
            h.commit(_transient(2, T0 + 10), _transient(3, T0 + 20), cursor="c2")
            h.commit(_transient(4, T0 + 30), cursor="c3")
            assert h.outbox.depth() == 1
            await poll(lambda: h.count("sent") == 2)
        assert len(h.recorder.payloads) == 2
        assert "crashes of this kind" not in json.dumps(h.recorder.payloads[0])
        assert "3 crashes of this kind" in h.recorder.payloads[1]["text"]
        assert h.clock.t >= T0 + h.config.group_interval_s  # waited for the interval
        assert all(row["notified"] for row in h.store.history())
        assert h.count("grouped") == 2

    async def test_other_signature_is_not_grouped(self, h: Harness) -> None:
        """A transient crash of another signature gets its own message."""
        other = make_outcome(
            invocation_id="x",
            signature="cuda_oom",
            severity=Severity.TRANSIENT,
            action=Action.ALLOW_RESTART,
        )
        h.commit(_transient(1, T0), other)
        assert h.outbox.depth() == 2


class TestDelivery:
    """Pacing, backoff and giving up."""

    async def test_min_interval_paces_messages(self, h: Harness) -> None:
        """Three messages are sent at least min_interval_s apart."""
        h.commit(*(make_outcome(invocation_id=f"i{n}") for n in range(3)))
        async with running(h.outbox):
            await poll(lambda: h.count("sent") == 3)
        assert sum(h.clock.slept) >= 2 * h.config.min_interval_s

    async def test_backoff_is_capped_and_attempts_bounded(self, tmp_path: Path) -> None:
        """Repeated 5xx back off up to backoff_max_s and stop after max_attempts."""
        h = Harness(tmp_path, Recorder((500,) * 20), max_attempts=6, backoff_max_s=4.0)
        h.commit(make_outcome())
        with structlog.testing.capture_logs() as logs:
            async with running(h.outbox):
                await poll(lambda: h.count("failed") == 1)
        assert len(h.recorder.payloads) == 6
        assert h.count("retried") == 5
        assert max(h.clock.slept) <= 4.0
        events = [e["event"] for e in logs]
        assert events.count("slack_delivery_failed") == 1  # identical errors: logged once
        assert events.count("slack_message_dropped") == 1
        assert not h.store.history()[0]["notified"]

    async def test_recovery_is_logged(self, tmp_path: Path) -> None:
        """After failures, the first success logs slack_delivery_recovered."""
        h = Harness(tmp_path, Recorder((503,)))
        h.commit(make_outcome())
        with structlog.testing.capture_logs() as logs:
            async with running(h.outbox):
                await poll(lambda: h.count("sent") == 1)
        assert "slack_delivery_recovered" in [e["event"] for e in logs]

    async def test_health_reports_repeated_failures(self, tmp_path: Path) -> None:
        """Three failures in a row make the outbox unhealthy with a reason."""
        h = Harness(tmp_path, Recorder((500,) * 50), max_attempts=50)
        h.commit(make_outcome())
        async with running(h.outbox):
            await poll(lambda: h.count("retried") >= 3)
            healthy, details = h.outbox.health()
        assert not healthy
        assert "slack failing" in details["reasons"][0]
        assert details["outbox_depth"] == 1

    async def test_wake_and_stop(self, h: Harness) -> None:
        """An idle outbox stops promptly when asked and wakes for new work."""
        async with running(h.outbox):
            h.outbox.wake()
            h.commit(make_outcome())
            await poll(lambda: h.count("sent") == 1)
        assert h.outbox.depth() == 0


def test_closed_database_is_a_state_error(h: Harness) -> None:
    """A broken database surfaces as StateError, not a raw sqlite3 error."""
    h.store.close()
    with pytest.raises(StateError):
        h.outbox.depth()
