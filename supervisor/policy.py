"""The restart-loop policy: decides halt, allow-restart or observe for each ended invocation.

Rules, in order:
1. An invocation that neither failed nor shows a crash is observed (a clean stop or exit).
2. A known fatal crash halts: the same crash recurs until a person acts.
3. A known transient crash is allowed to restart: a restart may work.
4. An unknown crash is allowed to restart until the same fingerprint has ended K consecutive
   invocations of the unit, whatever the time between them; then it halts.

The policy never halts what a restart would fix, and in dry-run it reports what it would do.
Its memory (the unknown-crash streak per unit) is plain data so the daemon can persist it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from supervisor.model import Action, Decision, Invocation, Severity, Verdict

DEFAULT_UNKNOWN_REPEAT_LIMIT = 3


@dataclass(slots=True)
class _Streak:
    fingerprint: str | None = None
    count: int = 0


class RestartPolicy:
    """Per-unit decisions with a memory of consecutive identical unknown crashes."""

    def __init__(self, state: dict[str, dict[str, Any]] | None = None) -> None:
        self._streaks: dict[str | None, _Streak] = {
            unit: _Streak(value.get("fingerprint"), int(value.get("count", 0)))
            for unit, value in (state or {}).items()
        }

    def decide(
        self,
        invocation: Invocation,
        verdict: Verdict,
        *,
        unknown_repeat_limit: int = DEFAULT_UNKNOWN_REPEAT_LIMIT,
        dry_run: bool = False,
    ) -> Decision:
        """The decision for one ended invocation; updates the unit's streak."""
        decision = self._decide(invocation, verdict, unknown_repeat_limit)
        if dry_run and decision.action is Action.HALT:
            return Decision(
                action=Action.HALT, reason=f"dry run, would halt: {decision.reason}", dry_run=True
            )
        return decision

    def _decide(self, invocation: Invocation, verdict: Verdict, limit: int) -> Decision:
        streak = self._streaks.setdefault(invocation.unit, _Streak())
        if invocation.result == "exec-condition":
            return Decision(action=Action.OBSERVE, reason="start skipped by its ExecCondition")
        if not (invocation.failed or verdict.crashed):
            streak.fingerprint, streak.count = None, 0
            return Decision(action=Action.OBSERVE, reason="ended without a crash")
        if verdict.severity is Severity.FATAL:
            streak.fingerprint, streak.count = None, 0
            return Decision(
                action=Action.HALT,
                reason=f"known fatal crash '{verdict.signature}': "
                "a restart would crash the same way",
            )
        if verdict.severity is Severity.TRANSIENT:
            streak.fingerprint, streak.count = None, 0
            return Decision(
                action=Action.ALLOW_RESTART,
                reason=f"transient crash '{verdict.signature}': a restart may work",
            )
        fingerprint = verdict.fingerprint or _silent_fingerprint(invocation)
        if fingerprint == streak.fingerprint:
            streak.count += 1
        else:
            streak.fingerprint, streak.count = fingerprint, 1
        if streak.count >= limit:
            return Decision(
                action=Action.HALT,
                reason=f"the same unknown crash (fingerprint {fingerprint}) ended "
                f"{streak.count} consecutive invocations (limit {limit})",
            )
        return Decision(
            action=Action.ALLOW_RESTART,
            reason=f"unknown crash (fingerprint {fingerprint}), {streak.count} of {limit} "
            "consecutive before a halt",
        )

    def state(self) -> dict[str, dict[str, Any]]:
        """The policy's memory, for the state database."""
        return {
            unit: {"fingerprint": s.fingerprint, "count": s.count}
            for unit, s in self._streaks.items()
            if unit is not None
        }

    def forget(self, unit: str) -> None:
        """Drop a unit's streak (after `release`)."""
        self._streaks.pop(unit, None)


def _silent_fingerprint(invocation: Invocation) -> str:
    """A crash with no root-cause line is known by how it ended."""
    return f"exit:{invocation.exit_code}:{invocation.exit_status}:{invocation.result}"
