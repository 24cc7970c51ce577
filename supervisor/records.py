"""An ended invocation not yet decided, or an outcome decided and not yet acted on, as a JSON
record and back.

The batch that ends an invocation commits its reading (`Ended`: the classifier's reading and the
facts of its cause) with its cursor; the unit's lane gathers the evidence, decides (the record
becomes the outcome's) and carries the action out, off the batch (supervisor.actions.lanes). A
supervisor that dies in between finds the record at its next start and goes on from there: an
ended one is decided then, a decided one (also every record of earlier versions) acted on.
`Outcome.to_json` is the history's contract and loses what the actor reads (the host and boot,
the restart counters, the enum members); these records keep every field but the invocation's
kept lines, which only the classifier reads, and it has run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from enum import Enum
from typing import Any

from .model import (
    Action,
    Basis,
    CauseFacts,
    Confidence,
    Decision,
    Ended,
    Ending,
    Invocation,
    Outcome,
    Pace,
    Rule,
    Severity,
    Taken,
    Verdict,
)
from .util.jsontext import whole_number

Pending = Ended | Outcome
"""A pending record: ended and to be decided, or decided and to be acted on."""


def outcome_record(outcome: Outcome) -> dict[str, Any]:
    """`outcome` as JSON-ready data (`outcome_from_record` reads it back)."""
    return {
        "invocation": _fields(outcome.invocation, skip=("lines",)),
        "verdict": _fields(outcome.verdict),
        "decision": _fields(outcome.decision),
        "drift": list(outcome.drift),
        "taken": outcome.taken.value,
        "taken_detail": outcome.taken_detail,
        "already_halted_by": outcome.already_halted_by,
    }


def ended_record(ended: Ended) -> dict[str, Any]:
    """`ended` as JSON-ready data (`pending_from_record` reads it back)."""
    return {
        "invocation": _fields(ended.invocation, skip=("lines",)),
        "reading": _fields(ended.reading),
        "facts": _fields(ended.facts),
    }


def pending_from_record(record: Mapping[str, Any]) -> Pending:
    """The ended invocation or the outcome a record holds (a record with a decision is an
    outcome, as every record of earlier versions is). Raises as `outcome_from_record`."""
    if "decision" in record:
        return outcome_from_record(record)
    facts = _known(CauseFacts, dict(record.get("facts") or {}))
    facts["callers"] = tuple(str(frame) for frame in facts.get("callers") or ())
    return Ended(
        invocation=_invocation(dict(record["invocation"])),
        reading=_verdict(dict(record["reading"])),
        facts=CauseFacts(**facts),
    )


def outcome_from_record(record: Mapping[str, Any]) -> Outcome:
    """The outcome `outcome_record` wrote; keys it does not know are ignored. Raises ValueError
    (or KeyError, TypeError) on a record that is not one."""
    invocation = _invocation(dict(record["invocation"]))
    verdict = _verdict(dict(record["verdict"]))
    raw_decision = dict(record["decision"])
    decision = Decision(
        action=Action(raw_decision["action"]),
        reason=str(raw_decision["reason"]),
        dry_run=bool(raw_decision.get("dry_run", False)),
        rule=Rule(raw_decision.get("rule", Rule.OTHER.value)),
        pace=_pace(raw_decision.get("pace")),
        crashes=whole_number(raw_decision.get("crashes")) or None,
    )
    return Outcome(
        invocation=invocation,
        verdict=verdict,
        decision=decision,
        drift=tuple(str(d) for d in record.get("drift") or ()),
        taken=Taken(record.get("taken", Taken.OBSERVED.value)),
        taken_detail=str(record.get("taken_detail", "")),
        already_halted_by=record.get("already_halted_by"),
    )


def _pace(raw: Any) -> Pace | None:
    """A held start's pace, as `_fields` wrote it (None for a record of an earlier version)."""
    if not isinstance(raw, Mapping):
        return None
    begins = raw.get("begins")
    return Pace(
        delay_s=float(raw["delay_s"]),
        crashes=int(raw["crashes"]),
        begins=begins if isinstance(begins, bool) else None,
    )


def _invocation(raw: Mapping[str, Any]) -> Invocation:
    return Invocation(
        **_known(Invocation, raw, skip=("lines",)),
        lines=(),
        ending=Ending(raw.get("ending", Ending.EXITED.value)),
    )


def _verdict(raw: Mapping[str, Any]) -> Verdict:
    leaning, basis, confidence = raw.get("leaning"), raw.get("basis"), raw.get("confidence")
    return Verdict(
        **_known(Verdict, raw),
        severity=Severity(raw["severity"]),
        captures={str(k): str(v) for k, v in dict(raw.get("captures") or {}).items()},
        notes=tuple(str(n) for n in raw.get("notes") or ()),
        packages=tuple(str(n) for n in raw.get("packages") or ()),
        leaning=None if leaning is None else Severity(leaning),
        basis=None if basis is None else Basis(basis),
        confidence=None if confidence is None else Confidence(confidence),
    )


# Fields given explicitly above (enums, mappings, tuples): never copied as they are.
_CONVERTED = frozenset(
    {"ending", "severity", "captures", "notes", "packages", "leaning", "basis", "confidence"}
)


def _fields(value: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        f.name: _plain(getattr(value, f.name))
        for f in dataclasses.fields(value)
        if f.name not in skip
    }


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _fields(value)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _known(cls: type, raw: Mapping[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)} - _CONVERTED - set(skip)
    return {k: v for k, v in raw.items() if k in names}
