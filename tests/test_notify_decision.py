"""Whether and how a crash is told (supervisor.notify.decision.telling): one reason per case."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from notify_fakes import make_outcome

from vllm_supervisor.model import Action, Decision, Ending, Outcome, Pace, Severity, Taken
from vllm_supervisor.notify.decision import NotifyReason, telling


@pytest.mark.parametrize(
    ("case", "outcome", "reason"),
    [
        ("fatal and halted", make_outcome(), NotifyReason.ALONE),
        (
            "transient, restarted",
            make_outcome(severity=Severity.TRANSIENT, action=Action.ALLOW_RESTART),
            NotifyReason.GROUPED,
        ),
        (
            "unknown, restarted",
            make_outcome(signature=None, severity=Severity.UNKNOWN, action=Action.ALLOW_RESTART),
            NotifyReason.ALONE,
        ),
        ("read late", make_outcome(taken=Taken.RECORDED), NotifyReason.BACKLOG),
        ("a clean exit", make_outcome(exit_status=0, signature=None), NotifyReason.NOT_NEWS),
    ],
)
def test_each_kind_of_end_has_its_reason(case: str, outcome, reason: NotifyReason) -> None:
    """Fatal and unknown crashes go alone, transient ones are grouped, late ones summarised."""
    assert telling(outcome, endpoint=True, notify_transient=True) is reason, case


def test_a_person_stop_is_never_news() -> None:
    """`systemctl stop` ends an invocation without a crash to tell."""
    outcome = make_outcome()
    stopped = dataclasses.replace(
        outcome, invocation=dataclasses.replace(outcome.invocation, ending=Ending.STOPPED)
    )
    assert telling(stopped, endpoint=True, notify_transient=True) is NotifyReason.NOT_NEWS


def test_transient_crashes_can_be_muted_but_never_a_halt() -> None:
    """`slack.notify_transient = false` drops restarted transient crashes, not fatal ones."""
    transient = make_outcome(severity=Severity.TRANSIENT, action=Action.ALLOW_RESTART)
    assert telling(transient, endpoint=True, notify_transient=False) is NotifyReason.MUTED
    assert telling(make_outcome(), endpoint=True, notify_transient=False) is NotifyReason.ALONE


@given(
    severity=st.sampled_from(Severity),
    action=st.sampled_from(Action),
    taken=st.sampled_from(Taken),
    exit_status=st.integers(0, 255),
    signature=st.none() | st.text(min_size=1, max_size=20),
    endpoint=st.booleans(),
    notify_transient=st.booleans(),
)
def test_every_outcome_has_exactly_one_reason(
    severity: Severity,
    action: Action,
    taken: Taken,
    exit_status: int,
    signature: str | None,
    endpoint: bool,
    notify_transient: bool,
) -> None:
    """No combination raises; without an endpoint nothing is told; a halt is never muted."""
    outcome = make_outcome(
        severity=severity, action=action, taken=taken, exit_status=exit_status, signature=signature
    )
    reason = telling(outcome, endpoint=endpoint, notify_transient=notify_transient)
    assert isinstance(reason, NotifyReason)
    if not endpoint:
        assert reason is NotifyReason.OFF
    if action is Action.HALT and reason.tells is False:
        assert reason in (NotifyReason.OFF, NotifyReason.NOT_NEWS)


def _held(crashes: int, severity: Severity, signature: str | None) -> Outcome:
    """A crash whose next start was held after `crashes` crashes in a row."""
    outcome = make_outcome(
        signature=signature, severity=severity, action=Action.ALLOW_RESTART, taken=Taken.HELD
    )
    pace = Pace(delay_s=60.0 * 2 ** max(0, crashes - 2), crashes=crashes)
    decision = Decision(action=Action.HOLD, reason="paced", pace=pace)
    return dataclasses.replace(outcome, decision=decision)


@pytest.mark.parametrize(
    ("severity", "signature"),
    [(Severity.UNKNOWN, None), (Severity.TRANSIENT, "hf_hub_rate_limited")],
    ids=["unknown", "transient"],
)
@pytest.mark.parametrize("notify_transient", [True, False])
def test_the_hold_that_begins_pacing_is_told_and_the_later_ones_fold(
    severity: Severity, signature: str | None, notify_transient: bool
) -> None:
    """The 2nd crash in a row (the first held start) is its own message, a transient loop's too
    (never grouped or muted: a hold is an action); the 3rd and later are PACED, told by that
    message, never one per crash of the loop."""
    first = telling(_held(2, severity, signature), endpoint=True, notify_transient=notify_transient)
    assert first is NotifyReason.ALONE
    for crashes in (3, 4, 40):
        later = _held(crashes, severity, signature)
        reason = telling(later, endpoint=True, notify_transient=notify_transient)
        assert reason is NotifyReason.PACED, crashes
        assert not reason.tells
