"""The restart-loop policy, as a decision table."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.decide.policy import RestartPolicy
from vllm_supervisor.model import (
    HALT_RULES,
    Action,
    Confidence,
    Ending,
    Invocation,
    Rule,
    Severity,
    Verdict,
)

CRASHED = Invocation(
    unit="vllm.service",
    invocation_id="i",
    lines=(),
    exit_code="exited",
    exit_status=1,
    result="exit-code",
)
CLEAN = Invocation(
    unit="vllm.service",
    invocation_id="i",
    lines=(),
    exit_code="exited",
    exit_status=0,
    result="success",
)
SKIPPED = Invocation(
    unit="vllm.service",
    invocation_id="i",
    lines=(),
    result="exec-condition",
    ending=Ending.SKIPPED,
)


def verdict(
    severity: Severity, fingerprint: str | None = "fp1", *, crashed: bool = True
) -> Verdict:
    signature = None if severity is Severity.UNKNOWN else f"sig_{severity}"
    return Verdict(
        signature=signature,
        severity=severity,
        title="t",
        root_cause="x",
        fingerprint=fingerprint,
        crashed=crashed,
    )


@pytest.mark.parametrize(
    ("invocation", "verdicts", "expected"),
    [
        # A known fatal crash halts at once.
        (CRASHED, [verdict(Severity.FATAL)], [Action.HALT]),
        # A transient crash is allowed to restart, however often: paced from the second.
        (CRASHED, [verdict(Severity.TRANSIENT)] * 5, [Action.ALLOW_RESTART] + [Action.HOLD] * 4),
        # The same unknown crash halts on the third consecutive invocation.
        (
            CRASHED,
            [verdict(Severity.UNKNOWN)] * 3,
            [Action.ALLOW_RESTART, Action.HOLD, Action.HALT],
        ),
        # Different unknown crashes never add up to a halt; they are paced.
        (
            CRASHED,
            [verdict(Severity.UNKNOWN, f"fp{n}") for n in range(5)],
            [Action.ALLOW_RESTART] + [Action.HOLD] * 4,
        ),
        # A transient crash in between breaks the unknown streak (not the pacing).
        (
            CRASHED,
            [
                verdict(Severity.UNKNOWN),
                verdict(Severity.UNKNOWN),
                verdict(Severity.TRANSIENT),
                verdict(Severity.UNKNOWN),
            ],
            [Action.ALLOW_RESTART] + [Action.HOLD] * 3,
        ),
        # An exit 0 that shows a fatal crash in its lines is still a crash (vLLM #48966).
        (CLEAN, [verdict(Severity.FATAL)], [Action.HALT]),
        # A clean exit without a crash is only observed.
        (CLEAN, [verdict(Severity.UNKNOWN, None, crashed=False)], [Action.OBSERVE]),
        # A start skipped by the quarantine gate is never counted as a crash.
        (SKIPPED, [verdict(Severity.UNKNOWN, None, crashed=False)] * 4, [Action.OBSERVE] * 4),
    ],
)
def test_decisions(invocation: Invocation, verdicts: list[Verdict], expected: list[Action]) -> None:
    """Each sequence of verdicts leads to the listed sequence of actions."""
    policy = RestartPolicy()
    assert [policy.decide(invocation, v).action for v in verdicts] == expected


def test_dry_run_reports_without_halting() -> None:
    """In dry-run the decision says it would halt and is marked as a dry run."""
    decision = RestartPolicy().decide(CRASHED, verdict(Severity.FATAL), dry_run=True)
    assert (decision.action, decision.dry_run) == (Action.HALT, True)
    assert decision.reason.startswith("dry run, would halt")


def test_streak_survives_a_restart_of_the_daemon() -> None:
    """The unknown-crash streak is restored from saved state, so restarts do not reset it."""
    first = RestartPolicy()
    first.decide(CRASHED, verdict(Severity.UNKNOWN))
    first.decide(CRASHED, verdict(Severity.UNKNOWN))
    second = RestartPolicy(first.state())
    assert second.decide(CRASHED, verdict(Severity.UNKNOWN)).action is Action.HALT


def test_silent_crashes_are_fingerprinted_by_how_they_ended() -> None:
    """A crash that printed nothing still halts after K identical endings."""
    policy = RestartPolicy()
    silent = verdict(Severity.UNKNOWN, None)
    actions = [policy.decide(CRASHED, silent).action for _ in range(3)]
    assert actions[-1] is Action.HALT


@given(
    ending=st.sampled_from(Ending),
    severity=st.sampled_from(Severity),
    basis=st.sampled_from([None, "signature", "inferred", "repeated", "unknown"]),
    exit_status=st.integers(0, 255),
    served=st.booleans(),
    fingerprint=st.none() | st.sampled_from(["a", "b"]),
    dry_run=st.booleans(),
    repeats=st.integers(1, 4),
)
def test_every_decision_names_a_bounded_rule(
    ending: Ending,
    severity: Severity,
    basis: str | None,
    exit_status: int,
    served: bool,
    fingerprint: str | None,
    dry_run: bool,
    repeats: int,
) -> None:
    """The rule is one of the enum's values whatever ended how (it is the metric label), a halt
    is counted under a halt rule, and dry run never changes the rule."""
    invocation = Invocation(
        unit="vllm.service",
        invocation_id="i",
        lines=(),
        exit_code="exited",
        exit_status=exit_status,
        result="exit-code" if exit_status else "success",
        ending=ending,
        started_us=1_000_000,
        served_us=2_000_000 if served else None,
    )
    crash = Verdict(
        signature=None,
        severity=severity,
        title="crash",
        root_cause=None,
        basis=basis,
        fingerprint=fingerprint,
        crashed=True,
    )
    wet, dry = RestartPolicy(), RestartPolicy()
    for _ in range(repeats):
        decision = wet.decide(invocation, crash)
        dry_decision = dry.decide(invocation, crash, dry_run=dry_run)
    assert isinstance(decision.rule, Rule)
    assert dry_decision.rule is decision.rule
    if decision.action is Action.HALT:
        assert decision.rule in HALT_RULES


def _ended_after(seconds: float, invocation_id: str = "i") -> Invocation:
    """A startup crash `seconds` after its start (its start read, no serving line)."""
    return Invocation(
        unit="vllm.service",
        invocation_id=invocation_id,
        lines=(),
        exit_code="exited",
        exit_status=1,
        result="exit-code",
        started_us=1_000_000,
        ended_us=1_000_000 + int(seconds * 1e6),
    )


def _leaning(leaning: Severity | None, fingerprint: str = "fp1") -> Verdict:
    return Verdict(
        signature=None,
        severity=Severity.UNKNOWN,
        title="t",
        root_cause="x",
        fingerprint=fingerprint,
        crashed=True,
        basis="unknown",
        leaning=leaning,
    )


class TestSecondIdenticalStartupCrash:
    """An unknown crash whose evidence leans deterministic halts when it ends the next start
    too, the same way after about the same time; without that lean, or at another time, the
    third identical crash halts as before."""

    def test_leaning_fatal_halts_on_the_second_identical_start(self) -> None:
        """Same fingerprint, 62 s then 60 s to crash, leaning fatal: halt on the second."""
        policy = RestartPolicy()
        first = policy.decide(_ended_after(62.0, "a"), _leaning(Severity.FATAL))
        second = policy.decide(_ended_after(60.0, "b"), _leaning(Severity.FATAL))
        assert (first.action, first.rule) == (Action.ALLOW_RESTART, Rule.UNKNOWN_FIRST)
        assert (second.action, second.rule) == (Action.HALT, Rule.UNKNOWN_REPEAT)
        assert "after about the same time" in second.reason
        assert "leans deterministic" in second.reason

    @pytest.mark.parametrize(
        ("leaning", "times"),
        [
            (None, (60.0, 60.0)),  # nothing leans: the third crash halts
            (Severity.TRANSIENT, (60.0, 60.0)),  # it leans transient
            (Severity.FATAL, (300.0, 40.0)),  # a different time to crash
        ],
    )
    def test_otherwise_the_third_halts(
        self, leaning: Severity | None, times: tuple[float, float]
    ) -> None:
        """Without a deterministic lean, or when the second took another time, the second
        crash restarts (paced) and the third identical one halts."""
        policy = RestartPolicy()
        actions = [
            policy.decide(_ended_after(seconds, f"{n}"), _leaning(leaning)).action
            for n, seconds in enumerate((*times, times[-1]))
        ]
        assert actions == [Action.ALLOW_RESTART, Action.HOLD, Action.HALT]

    def test_the_time_survives_a_restart_of_the_daemon(self) -> None:
        """The first crash's time to crash is kept in the saved state."""
        first = RestartPolicy()
        first.decide(_ended_after(60.0, "a"), _leaning(Severity.FATAL))
        second = RestartPolicy(first.state())
        assert second.decide(_ended_after(61.0, "b"), _leaning(Severity.FATAL)).action is (
            Action.HALT
        )

    @given(
        first=st.floats(1.0, 3600.0),
        second=st.floats(1.0, 3600.0),
        leaning=st.sampled_from([None, Severity.FATAL, Severity.TRANSIENT]),
    )
    def test_never_on_the_second_unless_it_leans_fatal_at_a_like_time(
        self, first: float, second: float, leaning: Severity | None
    ) -> None:
        """A halt on the second crash needs the fatal lean and times within a factor of two
        of each other (page cache: a second load reads the weights from memory)."""
        policy = RestartPolicy()
        policy.decide(_ended_after(first, "a"), _leaning(leaning))
        decision = policy.decide(_ended_after(second, "b"), _leaning(leaning))
        if decision.action is Action.HALT:
            assert leaning is Severity.FATAL
            assert min(first, second) * 2 >= max(first, second) or abs(first - second) <= 15


def _paced_actions(seconds: list[float], reset_s: float = 600.0) -> list[Action]:
    """What rule 7 makes of crashes allowed to restart after these times to crash: held from
    the 2nd in a row of starts that ran less than the reset; a start that ran it starts anew."""
    actions, in_a_row = [], 0
    for ran in seconds:
        in_a_row = 0 if ran >= reset_s else in_a_row + 1
        actions.append(Action.HOLD if in_a_row >= 2 else Action.ALLOW_RESTART)
    return actions


class TestNoCauseNeverHaltsByRepetition:
    """A crash no line explains (low confidence: a guess, a pointer, PID 1's record), leaning
    nowhere, whose ending names no cause either, is restarted however often it repeats (paced,
    never halted)."""

    @given(
        confidence=st.sampled_from([None, *Confidence]),
        leaning=st.sampled_from([None, Severity.FATAL, Severity.TRANSIENT]),
        ending=st.sampled_from(
            [
                ("exited", 1, "exit-code"),
                ("killed", 6, "signal"),
                ("dumped", 11, "core-dump"),
                ("killed", 9, "timeout"),
                ("killed", 6, "watchdog"),
            ]
        ),
        seconds=st.lists(st.floats(1.0, 3600.0), min_size=1, max_size=8),
    )
    def test_only_an_explained_crash_halts_by_repetition(
        self,
        confidence: Confidence | None,
        leaning: Severity | None,
        ending: tuple[str, int, str],
        seconds: list[float],
    ) -> None:
        exit_code, exit_status, result = ending
        verdict = dataclasses.replace(_leaning(leaning), confidence=confidence)
        policy = RestartPolicy()
        decisions = [
            policy.decide(
                dataclasses.replace(
                    _ended_after(s, f"{n}"),
                    exit_code=exit_code,
                    exit_status=exit_status,
                    result=result,
                ),
                verdict,
            )
            for n, s in enumerate(seconds)
        ]
        unexplained = (
            confidence is Confidence.LOW
            and leaning is not Severity.FATAL
            and exit_code != "dumped"
            and result not in ("core-dump", "timeout", "watchdog")
        )
        if unexplained:  # never halted; paced from the 2nd crash in a row (rule 7)
            assert [d.action for d in decisions] == _paced_actions(seconds)
            assert all(d.rule is Rule.UNKNOWN_NO_CAUSE for d in decisions[2:])
        elif leaning is not Severity.FATAL and len(seconds) >= 3:
            assert decisions[2].action is Action.HALT  # the third identical crash, as before
