"""An outcome as the record of an action decided and not yet taken, and back
(supervisor.records): what a supervisor killed in between reads at its next start."""

import dataclasses
import json
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.model import (
    Action,
    Basis,
    CauseFacts,
    Confidence,
    Decision,
    Ended,
    Ending,
    Invocation,
    LogLine,
    Outcome,
    Rule,
    Severity,
    Taken,
    Verdict,
)
from vllm_supervisor.records import (
    ended_record,
    outcome_from_record,
    outcome_record,
    pending_from_record,
)
from vllm_supervisor.store import Checkpoint, Store

TEXT = st.text(max_size=20)
MAYBE_TEXT = st.none() | TEXT
MAYBE_INT = st.none() | st.integers(min_value=-(2**40), max_value=2**40)


def _invocations() -> st.SearchStrategy[Invocation]:
    return st.builds(
        Invocation,
        unit=MAYBE_TEXT,
        invocation_id=MAYBE_TEXT,
        lines=st.lists(st.builds(LogLine, text=TEXT), max_size=2).map(tuple),
        total_lines=st.integers(0, 10**6),
        ending=st.sampled_from(Ending),
        host=MAYBE_TEXT,
        boot_id=MAYBE_TEXT,
        restart_scheduled=MAYBE_INT,
        exit_code=MAYBE_TEXT,
        exit_status=MAYBE_INT,
        result=MAYBE_TEXT,
        restarts=MAYBE_INT,
        hung=st.booleans(),
        started_us=MAYBE_INT,
        ended_us=MAYBE_INT,
        ran_monotonic_s=st.none() | st.floats(allow_nan=False, allow_infinity=False),
        last_cursor=MAYBE_TEXT,
    )


OUTCOMES = st.builds(
    Outcome,
    invocation=_invocations(),
    verdict=st.builds(
        Verdict,
        signature=MAYBE_TEXT,
        severity=st.sampled_from(Severity),
        title=TEXT,
        root_cause=MAYBE_TEXT,
        captures=st.dictionaries(TEXT, TEXT, max_size=3),
        notes=st.lists(TEXT, max_size=3).map(tuple),
        crashed=st.booleans(),
        basis=st.none() | st.sampled_from(Basis),
        confidence=st.none() | st.sampled_from(Confidence),
        leaning=st.none() | st.sampled_from(Severity),
    ),
    decision=st.builds(
        Decision,
        action=st.sampled_from(Action),
        reason=TEXT,
        dry_run=st.booleans(),
        rule=st.sampled_from(Rule),
    ),
    drift=st.lists(TEXT, max_size=3).map(tuple),
    taken=st.sampled_from(Taken),
    taken_detail=TEXT,
    already_halted_by=MAYBE_TEXT,
)


@given(OUTCOMES)
def test_a_pending_record_reads_back_as_its_outcome_without_its_lines(outcome: Outcome) -> None:
    """Through JSON and back, every field the actor, the halt and the message read survives;
    only the kept lines (the classifier's, which has run) are left out."""
    text = json.dumps(outcome_record(outcome))
    again = outcome_from_record(json.loads(text))
    without_lines = dataclasses.replace(
        outcome, invocation=dataclasses.replace(outcome.invocation, lines=())
    )
    assert again == without_lines
    assert again.to_json() == outcome.to_json()


@given(st.dictionaries(TEXT, st.none() | TEXT | st.integers() | st.lists(TEXT)))
def test_a_record_that_is_not_one_raises_a_clear_error(record: dict[str, object]) -> None:
    """Anything else in the table is refused with KeyError, ValueError or TypeError (the store
    names it in one line and leaves it), never taken for an outcome."""
    try:
        outcome_from_record(record)
    except (KeyError, ValueError, TypeError):
        return
    raise AssertionError(f"read as an outcome: {record}")


@given(
    OUTCOMES,
    st.builds(
        CauseFacts,
        words=MAYBE_TEXT,
        frame=MAYBE_TEXT,
        callers=st.lists(st.text(max_size=40), max_size=3).map(tuple),
        pointer=st.booleans(),
    ),
)
def test_an_ended_record_reads_back_as_its_reading_without_its_lines(
    outcome: Outcome, facts: CauseFacts
) -> None:
    """An invocation that ended and is not yet decided: its reading and the facts of its cause
    survive JSON, so a supervisor killed before deciding decides it at its next start."""
    ended = Ended(invocation=outcome.invocation, reading=outcome.verdict, facts=facts)
    again = pending_from_record(json.loads(json.dumps(ended_record(ended))))
    assert again == Ended(
        invocation=dataclasses.replace(outcome.invocation, lines=()),
        reading=outcome.verdict,
        facts=facts,
    )


# A pending action as the version before evidence-first decisions wrote it (no "reading").
EARLIER_RECORD = {
    "invocation": {"unit": "vllm.service", "invocation_id": "b" * 32, "ending": "exited",
                   "exit_code": "exited", "exit_status": 1, "result": "exit-code"},
    "verdict": {"signature": None, "severity": "fatal", "title": "Crash", "root_cause": "x",
                "basis": "inferred", "confidence": "medium", "notes": ["n"], "captures": {}},
    "decision": {"action": "halt", "reason": "r", "dry_run": False, "rule": "inferred_fatal"},
    "drift": ["torch 2.5.1 → 2.6.0"],
    "taken": "observed",
    "taken_detail": "",
    "already_halted_by": None,
}  # fmt: skip


def test_a_pending_action_of_the_earlier_version_loads_as_an_outcome(tmp_path: Path) -> None:
    """Records in a state database of the version before still load: decided, to be acted on."""
    store = Store.in_directory(tmp_path)
    store.write_blocking(
        lambda db: db.execute(
            "INSERT INTO pending_action (unit, key, outcome) VALUES (?, ?, ?)",
            ("vllm.service", "b" * 32, json.dumps(EARLIER_RECORD)),
        )
    )
    (pending,), unreadable = store.pending_actions()
    assert unreadable == []
    assert isinstance(pending, Outcome)
    assert (pending.decision.action, pending.decision.rule) == (Action.HALT, Rule.INFERRED_FATAL)
    assert (pending.verdict.basis, pending.verdict.confidence) == (
        Basis.INFERRED,
        Confidence.MEDIUM,
    )
    assert pending.drift == ("torch 2.5.1 → 2.6.0",)
    # Decided again over an ended record, then taken: the record is gone.
    store.commit_batch(checkpoint=Checkpoint(cursor="c", replay_from=None), outcomes=[pending])
    assert store.pending_actions() == ([], [])
    store.close()
