"""An outcome as a JSON record and back, for an action decided but not yet taken.

The batch that decides an invocation commits its outcome with its cursor; the action is carried
out after, off the batch (supervisor.actions.lanes). A supervisor that dies in between finds the
record at its next start and carries the action out then. `Outcome.to_json` is the history's
contract and loses what the actor reads (the host and boot, the restart counters, the enum
members); this record keeps every field but the invocation's kept lines, which only the
classifier reads, and it has run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from enum import Enum
from typing import Any

from .model import Action, Decision, Ending, Invocation, Outcome, Rule, Severity, Taken, Verdict


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


def outcome_from_record(record: Mapping[str, Any]) -> Outcome:
    """The outcome `outcome_record` wrote; keys it does not know are ignored. Raises ValueError
    (or KeyError, TypeError) on a record that is not one."""
    raw_inv, raw_verdict = dict(record["invocation"]), dict(record["verdict"])
    raw_decision = dict(record["decision"])
    invocation = Invocation(
        **_known(Invocation, raw_inv, skip=("lines",)),
        lines=(),
        ending=Ending(raw_inv.get("ending", Ending.EXITED.value)),
    )
    leaning = raw_verdict.get("leaning")
    verdict = Verdict(
        **_known(Verdict, raw_verdict),
        severity=Severity(raw_verdict["severity"]),
        captures={str(k): str(v) for k, v in dict(raw_verdict.get("captures") or {}).items()},
        notes=tuple(str(n) for n in raw_verdict.get("notes") or ()),
        leaning=None if leaning is None else Severity(leaning),
    )
    decision = Decision(
        action=Action(raw_decision["action"]),
        reason=str(raw_decision["reason"]),
        dry_run=bool(raw_decision.get("dry_run", False)),
        rule=Rule(raw_decision.get("rule", Rule.OTHER.value)),
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


# Fields given explicitly above (enums, mappings, tuples): never copied as they are.
_CONVERTED = frozenset({"ending", "severity", "captures", "notes", "leaning"})


def _fields(value: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        f.name: _plain(getattr(value, f.name))
        for f in dataclasses.fields(value)
        if f.name not in skip
    }


def _plain(value: Any) -> Any:
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
