"""The Slack message of a held start (pacing): it says the unit is paced, when the next start
comes (UTC), after how many crashes in a row, on what evidence (the root cause, or that no error
line names one), what to check, and `vllm-supervisor release UNIT` to start it now. Only the
hold that begins pacing reaches Slack; the holds after it are folded into it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from conftest import poll
from hypothesis import given
from hypothesis import strategies as st
from notify_fakes import T0, FakeClock, make_outcome, running
from slack_server import SlackServer
from test_slack import _count, _outbox, _queue, _texts, assert_within_limits

from vllm_supervisor.model import (
    Action,
    Confidence,
    Decision,
    Outcome,
    Pace,
    Rule,
    Severity,
    Taken,
)
from vllm_supervisor.notify.message import (
    NO_CAUSE_NAMED,
    build_payload,
)
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

UNIT = "vllm.service"
CAUSE = "OSError: [Errno 101] Network is unreachable: huggingface.co"


def held(
    *,
    crashes: int = 2,
    delay_s: float = 60.0,
    rule: Rule = Rule.TRANSIENT,
    root_cause: str = CAUSE,
    confidence: Confidence | None = Confidence.HIGH,
    ended_s: float | None = T0,
    invocation_id: str = "inv-2",
) -> Outcome:
    """A crash whose next start the daemon held, as the actor leaves it."""
    outcome = make_outcome(
        signature=None,
        severity=Severity.UNKNOWN,
        action=Action.ALLOW_RESTART,
        taken=Taken.HELD,
        root_cause=root_cause,
        invocation_id=invocation_id,
    )
    ended_us = None if ended_s is None else int(ended_s * 1_000_000)
    return dataclasses.replace(
        outcome,
        invocation=dataclasses.replace(outcome.invocation, ended_us=ended_us),
        verdict=dataclasses.replace(outcome.verdict, confidence=confidence),
        decision=Decision(
            action=Action.HOLD,
            reason=f"{rule.value}; paced: {crashes} crashes in a row, each within 10 min",
            rule=rule,
            pace=Pace(delay_s=delay_s, crashes=crashes),
        ),
        taken_detail="next start held until 08:01:00 UTC (1 min; it crashed)",
    )


def section(payload: dict, title: str) -> str:
    """The text of the payload's section named `title`."""
    found = [t for t in _texts(payload) if t.startswith(f"*{title}*\n")]
    assert len(found) == 1, title
    return found[0]


def test_the_paced_section_says_when_after_what_and_why() -> None:
    """T0 is 08:00:00 UTC: held 1 min, the next start comes at about 08:01 UTC; 2 crashes in a
    row; the root cause as the evidence and the rule; the commands to check; release to start
    it now (in the action line, where a halt has its release)."""
    payload = build_payload(held(), host="gpu-7")
    paced = section(payload, "Paced")
    assert (
        "The next start comes at about 08:01 UTC (1 min after this crash), after 2 crashes in "
        "a row, each soon after its start."
    ) in paced
    assert f"Evidence: {CAUSE} (rule transient: not proven fatal, so not halted)" in paced
    assert (
        f"Check: `vllm-supervisor status {UNIT}`, `systemctl list-timers "
        f"'vllm-supervisor-hold-*'`, `journalctl -u {UNIT}`"
    ) in paced
    action = section(payload, "Action")
    assert action.startswith("*Action*\n:hourglass_flowing_sand: held: ")
    assert action.endswith(f"To start it now: `vllm-supervisor release {UNIT}`")


def test_the_plain_text_says_the_same() -> None:
    """The fallback, what a phone's notification shows, has the same facts, one per line."""
    text = build_payload(held(crashes=3, delay_s=120.0), host="gpu-7")["text"]
    lines = text.splitlines()
    assert (
        "Paced, not halted. The next start comes at about 08:02 UTC (2 min after this crash), "
        "after 3 crashes in a row, each soon after its start. Each further crash doubles the "
        "wait; a start that runs the unit's `pace_reset_s` ends it."
    ) in lines
    assert f"Evidence: {CAUSE} (rule transient: not proven fatal, so not halted)" in lines
    assert (
        f"Check: vllm-supervisor status {UNIT}; systemctl list-timers 'vllm-supervisor-hold-*'; "
        f"journalctl -u {UNIT}"
    ) in lines
    assert f"Start it now: vllm-supervisor release {UNIT}" in lines
    assert not any(line.startswith("Release:") for line in lines)  # a halt's words


def test_a_cause_no_line_names_is_said_so() -> None:
    """A guessed root cause (low confidence) or the rule `unknown_no_cause` is no evidence: the
    message says no error line names the cause, not the guess."""
    for outcome in (
        held(confidence=Confidence.LOW, rule=Rule.UNKNOWN_FIRST),
        held(rule=Rule.UNKNOWN_NO_CAUSE),
        held(root_cause=""),
    ):
        payload = build_payload(outcome, host="gpu-7")
        paced = section(payload, "Paced")
        rule = outcome.decision.rule.value
        assert f"Evidence: {NO_CAUSE_NAMED} (rule {rule}: not proven fatal" in paced
        assert CAUSE not in paced
        assert f"Evidence: {NO_CAUSE_NAMED}" in payload["text"]


def test_an_end_time_not_known_gives_the_delay_alone() -> None:
    """Without the crash's end time the message gives the delay, not a made-up clock time."""
    paced = section(build_payload(held(ended_s=None, delay_s=240.0), host="h"), "Paced")
    assert "The next start comes 4 min after this crash, after 2 crashes" in paced
    assert "UTC" not in paced


def test_only_a_held_start_is_paced() -> None:
    """Every other outcome keeps its message: no Paced section, no "start it now"."""
    for taken in Taken:
        payload = build_payload(make_outcome(taken=taken), host="h")
        has_section = any(t.startswith("*Paced*") for t in _texts(payload))
        assert has_section == (taken is Taken.HELD), taken
        assert ("Start it now:" in payload["text"]) == (taken is Taken.HELD), taken


@given(
    crashes=st.integers(min_value=-(2**63), max_value=2**63),
    delay_s=st.floats(min_value=0, allow_nan=False, allow_infinity=False),
    ended_s=st.none() | st.floats(min_value=-1e12, max_value=1e13),
    root_cause=st.text(max_size=5000),
    unit=st.text(min_size=1, max_size=300),
    rule=st.sampled_from([r for r in Rule if r is not Rule.SERVING_AGAIN]),  # a crash's rule
)
def test_any_held_outcome_renders_within_slack_limits(
    crashes: int, delay_s: float, ended_s: float | None, root_cause: str, unit: str, rule: Rule
) -> None:
    """A pace read back from the history (records.py), a journal's end time and lines of any
    size or content: a payload within Slack's limits, no mention or link, the release command
    always in it."""
    outcome = held(crashes=crashes, delay_s=delay_s, ended_s=ended_s, root_cause=root_cause)
    outcome = dataclasses.replace(
        outcome,
        invocation=dataclasses.replace(outcome.invocation, unit=unit),
        decision=dataclasses.replace(outcome.decision, rule=rule),
    )
    payload = build_payload(outcome, host="gpu-7")
    assert_within_limits(payload)
    assert "<" not in json.dumps(payload)  # every < of the input is &lt;
    assert "vllm-supervisor release " in section(payload, "Action")


class TestOnlyTheFirstHoldIsSent:
    """Through the outbox to a real HTTP server: the hold that begins pacing is one message;
    the next crash's hold is folded into it (marked told), not sent."""

    async def test_the_second_hold_is_folded(self, slack: SlackServer, tmp_path: Path) -> None:
        clock, metrics = FakeClock(), Metrics(new_registry(process=False))
        store, outbox = _outbox(tmp_path / "s.db", slack.url, clock, metrics)
        _queue(store, outbox, held(crashes=2, invocation_id="inv-2"), cursor="c2")
        _queue(store, outbox, held(crashes=3, delay_s=120.0, invocation_id="inv-3"), cursor="c3")
        async with running(outbox):
            await poll(lambda: all(row["notified"] for row in store.history()))
            await poll(lambda: _count(metrics, "sent") == 1.0)
        store.close()
        assert slack.count() == 1
        (sent,) = [request.json() for request in slack.requests]
        assert "after 2 crashes in a row" in sent["text"]
        assert "Invocation*\ninv-2" in json.dumps(sent["blocks"]).replace("\\n", "\n")
        assert _count(metrics, "folded") == 1.0
