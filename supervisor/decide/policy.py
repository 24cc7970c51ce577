"""The restart-loop policy: decides halt, allow-restart or observe for each ended invocation.

Rules, in order:
1. An ending that is not a crash (supervisor.model.ENDINGS) is observed: a start that never
   ran the server (skipped by the gate, stopped while the gate ran), systemd giving up
   (start-limit-hit), the host's boot, a stop or restart job (a person's `systemctl stop`,
   whatever exit status the server returned: systemd never restarts what a stop job ended).
2. An invocation that neither failed nor shows a crash is observed (a clean stop or exit).
3. A port-in-use crash whose port's holder outlives the unit's restarts halts (the evidence
   gathered before the decision, supervisor.decide.port_evidence).
4. A fatal crash halts: the same crash recurs until a person acts. Fatal by a signature, or
   inferred fatal (supervisor.classify.determinism: a deterministic error before the server ever
   served); the latter can be turned off per unit (`halt_inferred = false`), and then counts
   as unknown. A fatal crash after the server served longer than `repeat_window_s` is
   restarted (`fatal_after_serving`): the same start served, the evidence disagrees.
5. A transient crash (by a signature, or inferred) is allowed to restart: a restart may work.
6. An unknown crash is allowed to restart until the same fingerprint has ended K consecutive
   invocations of the unit; then it halts (a crash that printed nothing is known by how it
   ended: exit code, status, result). A crash after serving counts only when it came within
   `repeat_window_s` of serving (the first request crashes it every time); one after longer
   serving starts the count afresh and never halts by repetition: repeats after serving are no
   proof of determinism. A startup crash whose evidence leans deterministic (`Verdict.leaning`,
   supervisor.classify.determinism: too weak to infer fatal on its own) halts on the second:
   the same fingerprint after about the same time to crash (within a factor of two, or 15 s: a
   second load reads the weights from the page cache) is the repetition that settles it. A
   crash that leans transient, or none, or came at another time, waits for the K-th: a
   process the last start left behind (GPU memory, a port) can outlive one restart.
   A crash no error line names the cause of (a traceback cut before its exception, a wrapper
   that only points elsewhere, a warning, nothing printed; a core dump or systemd's own
   timeout is a cause's record) never halts by repetition (`unknown_no_cause`): a hub outage
   or someone's kill repeats as identically, and a halt on nothing costs an outage where a
   missed one costs a reload.
   Another host's recent, unreleased halt of the same crash (fingerprint) with the same
   environment (supervisor.decide.fleet) halts at the first crash (`fleet_proof`), unless this
   crash leans transient or names no cause, or the unit halts on nothing inferred
   (`halt_inferred = false`): that host's repetitions are this one's.
7. A crash allowed to restart (rules 4 to 6) is paced (supervisor.decide.pacing): from the 2nd
   crash in a row of starts that ended within `pace_reset_s` (10 minutes), the decision is
   `hold`, the next start waiting a delay that doubles with each further crash up to the unit's
   cap. A start that runs `pace_reset_s`, a person's stop and a reboot end the run of crashes.
   So every loop ends: halted on evidence, or paced.

The policy decides what *should* happen to a unit whose crash is the present one; whether it
is (the daemon asks systemd) is the actions' business (supervisor.actions). In dry-run it
reports what it would do. Its memory (the crash streaks per host and unit) is plain data so the
daemon can persist it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..model import (
    ENDINGS,
    Action,
    Basis,
    Confidence,
    Decision,
    Evidence,
    GpuXid,
    Invocation,
    Pace,
    Phase,
    Rule,
    Severity,
    Verdict,
    duration,
)
from ..util.jsontext import whole_number
from .pacing import Schedule

DEFAULT_UNKNOWN_REPEAT_LIMIT = 3
_HOST_SEPARATOR = "\t"  # between a unit and its host in a saved key: no unit name holds one
# Two startup crashes "after about the same time": within this factor, or this many seconds.
SAME_TIME_FACTOR = 2.0
SAME_TIME_SLACK_S = 15.0


@dataclass(frozen=True, slots=True)
class _Rules:
    """A unit's settings the policy applies."""

    unknown_repeat_limit: int
    halt_inferred: bool
    repeat_window_s: float


@dataclass(slots=True)
class _Streak:
    fingerprint: str | None = None
    count: int = 0
    ran_s: float | None = None  # the last crash's time from start to end, when known
    crashes: int = 0  # crashes in a row of starts that ended within the reset (pacing)


def _seconds_or_none(value: object) -> float | None:
    """A saved duration read back: the state database is a file and may hold anything."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        return None


class RestartPolicy:
    """Per-host, per-unit decisions with a memory of consecutive crashes.

    The memory is kept per (host, unit): a journal directory may hold several hosts' runs of
    the same unit, and another host's crash must never count towards this host's halt or hold.
    Saved, a key is the unit's name, with its host after a tab (no unit name holds a tab); a
    key of an earlier version (the unit alone) goes to the first host that crashes the unit.
    """

    def __init__(self, state: dict[str, dict[str, Any]] | None = None) -> None:
        self._streaks: dict[tuple[str, str], _Streak] = {}
        for key, value in (state or {}).items():
            if isinstance(value, dict) and isinstance(key, str):
                count, ran_s = value.get("count", 0), value.get("ran_s")
                unit, _, host = key.partition(_HOST_SEPARATOR)
                self._streaks[(host, unit)] = _Streak(
                    value.get("fingerprint"),
                    count if isinstance(count, int) else 0,
                    _seconds_or_none(ran_s),
                    whole_number(value.get("crashes")),
                )

    def _streak(self, invocation: Invocation) -> _Streak:
        """The memory of `invocation`'s host and unit (an earlier version's, unit alone, is
        taken over by the first host that asks)."""
        unit, host = invocation.unit or "", invocation.host or ""
        found = self._streaks.get((host, unit))
        if found is None:
            found = self._streaks.pop(("", unit), None) or _Streak()
            self._streaks[(host, unit)] = found
        return found

    def decide(
        self,
        invocation: Invocation,
        verdict: Verdict,
        evidence: Evidence | None = None,
        *,
        unknown_repeat_limit: int = DEFAULT_UNKNOWN_REPEAT_LIMIT,
        halt_inferred: bool = True,
        repeat_window_s: float = 120.0,
        schedule: Schedule | None = None,
        dry_run: bool = False,
    ) -> Decision:
        """The decision for one ended invocation and its evidence (supervisor.model.Evidence,
        gathered before: the phase, the port's holder); updates the unit's streak."""
        evidence = evidence or Evidence(
            phase=Phase(served=invocation.served, ran_s=invocation.ran_s)
        )
        rules = _Rules(unknown_repeat_limit, halt_inferred, repeat_window_s)
        decision = self._decide(invocation, verdict, evidence, rules)
        decision = self._paced(invocation, decision, evidence.phase, schedule or Schedule())
        decision = _said_lost(decision, invocation, verdict)
        return _as_dry_run(decision) if dry_run else decision

    def _paced(
        self, invocation: Invocation, decision: Decision, phase: Phase, schedule: Schedule
    ) -> Decision:
        """Rule 7: a crash allowed to restart, in a run of starts that each ended within the
        reset, holds the next start (supervisor.decide.pacing); the run is counted here."""
        streak = self._streak(invocation)
        if decision.action is Action.OBSERVE:
            if ENDINGS[invocation.ending].resets_streak or decision.rule is Rule.CLEAN_EXIT:
                streak.crashes = 0
            return decision
        if decision.action is not Action.ALLOW_RESTART or schedule.ends_the_run(phase):
            streak.crashes = 0  # a halt ends the loop; a start that served ends the run
            return decision
        streak.crashes += 1
        delay = schedule.delay(streak.crashes)
        if delay is None:
            return decision
        return Decision(
            action=Action.HOLD,
            reason=f"{decision.reason}; paced: {streak.crashes} crashes in a row, each within "
            f"{duration(schedule.reset_s)} of its start, so the next start waits "
            f"{duration(delay)}",
            rule=decision.rule,
            pace=Pace(delay_s=delay, crashes=streak.crashes),
        )

    def _decide(
        self, invocation: Invocation, verdict: Verdict, evidence: Evidence, rules: _Rules
    ) -> Decision:
        streak = self._streak(invocation)
        meaning = ENDINGS[invocation.ending]
        if meaning.not_a_crash is not None:
            if meaning.resets_streak:
                streak.fingerprint, streak.count = None, 0  # a person (or a reboot) stepped in
            return _observe(*meaning.not_a_crash)
        if not (invocation.failed or verdict.crashed):
            streak.fingerprint, streak.count = None, 0
            return _observe(Rule.CLEAN_EXIT, "ended without a crash")
        if (xid := evidence.xid) is not None and xid.meaning is not None:
            return _gpu_fault(xid, streak)
        phase, port = evidence.phase, evidence.port
        if port is not None and port.outlives and rules.halt_inferred:
            # The port's holder outlives the unit's restarts (supervisor.decide.port_evidence):
            # each restart would reload the model just to fail to bind again.
            streak.fingerprint, streak.count = None, 0
            return Decision(
                action=Action.HALT,
                reason=verdict.severity_reason or f"port {port.port} is held",
                rule=Rule.PORT_HELD,
            )
        fingerprint = verdict.fingerprint or _silent_fingerprint(invocation)
        # With no serving line (`--uvicorn-log-level warning`), served is known from the
        # crash's request frames or the run's length, and the run served at most as long as
        # it ran: a start that crashed at its first request is a repeat right after serving.
        served_s = phase.serving_s if phase.serving_s is not None else phase.ran_s
        long_served = phase.served and (served_s is None or served_s > rules.repeat_window_s)
        inferred = verdict.basis is Basis.INFERRED
        if verdict.severity is Severity.FATAL and long_served:
            # A crash the table calls fatal, after the server served for long: the evidence
            # disagrees (the same start served). Restart; if it crashes again right after
            # serving, that crash halts.
            streak.fingerprint, streak.count = None, 0
            return Decision(
                action=Action.ALLOW_RESTART,
                reason=f"'{verdict.signature or 'fatal (inferred)'}' {phase.describe()}: "
                "the same start served, so a restart may work; a repeat right after "
                "serving halts",
                rule=Rule.FATAL_AFTER_SERVING,
            )
        if verdict.severity is Severity.FATAL and (rules.halt_inferred or not inferred):
            streak.fingerprint, streak.count = None, 0
            if inferred:
                return Decision(
                    action=Action.HALT,
                    reason=f"{verdict.severity_reason or 'fatal (inferred)'}: a restart would "
                    "crash the same way",
                    rule=Rule.INFERRED_FATAL,
                    crashes=1,
                )
            return Decision(
                action=Action.HALT,
                reason=f"known fatal crash '{verdict.signature}': "
                "a restart would crash the same way",
                rule=Rule.FATAL_SIGNATURE,
                crashes=1,
            )
        if verdict.severity is Severity.TRANSIENT:
            streak.fingerprint, streak.count = None, 0
            what = f"'{verdict.signature}'" if verdict.signature else "(inferred)"
            return Decision(
                action=Action.ALLOW_RESTART,
                reason=f"transient crash {what}: a restart may work",
                rule=Rule.TRANSIENT,
            )
        if long_served:
            streak.fingerprint, streak.count = None, 0  # the count starts afresh
            return Decision(
                action=Action.ALLOW_RESTART,
                reason=f"unknown crash (fingerprint {fingerprint}) {phase.describe()}: a restart "
                "may work, and repeats after serving are no proof",
                rule=Rule.UNKNOWN_AFTER_SERVING,
            )
        previous_s = streak.ran_s if fingerprint == streak.fingerprint else None
        if fingerprint == streak.fingerprint:
            streak.count += 1
        else:
            streak.fingerprint, streak.count = fingerprint, 1
        streak.ran_s = phase.ran_s
        limit = rules.unknown_repeat_limit
        proof = evidence.fleet
        if (
            proof is not None
            and rules.halt_inferred  # a unit that halts on its own repeats and signatures alone
            and proof.crash == fingerprint
            and verdict.leaning is not Severity.TRANSIENT
            and not names_no_cause(invocation, verdict)
        ):
            return Decision(
                action=Action.HALT,
                reason=f"{proof.cited()}, and this crash has the same fingerprint "
                f"({fingerprint}) in the same environment: a restart would crash the same way",
                rule=Rule.FLEET_PROOF,
                crashes=streak.count,
            )
        if streak.count >= limit and names_no_cause(invocation, verdict):
            return Decision(
                action=Action.ALLOW_RESTART,
                reason=f"the same crash (fingerprint {fingerprint}) ended {streak.count} "
                f"consecutive invocations, each {phase.describe()}, but no error line names "
                "its cause: not halted on repetition alone (a hub outage or a kill repeats "
                "too); read the unit's journal",
                rule=Rule.UNKNOWN_NO_CAUSE,
            )
        if streak.count >= limit:
            return Decision(
                action=Action.HALT,
                reason=f"the same unknown crash (fingerprint {fingerprint}) ended "
                f"{streak.count} consecutive invocations (limit {limit}), each "
                f"{phase.describe()}",
                rule=Rule.UNKNOWN_REPEAT,
                crashes=streak.count,
            )
        if (
            streak.count == 2
            and verdict.leaning is Severity.FATAL
            and not phase.served
            and _about_the_same(previous_s, phase.ran_s)
        ):
            return Decision(
                action=Action.HALT,
                reason=f"the same unknown crash (fingerprint {fingerprint}) ended 2 consecutive "
                f"starts, each {phase.describe()} after about the same time "
                f"({_seconds(previous_s)} and {_seconds(phase.ran_s)}), and its evidence leans "
                "deterministic",
                rule=Rule.UNKNOWN_REPEAT,
                crashes=streak.count,
            )
        return Decision(
            action=Action.ALLOW_RESTART,
            reason=f"unknown crash (fingerprint {fingerprint}), {streak.count} of {limit} "
            "consecutive before a halt",
            rule=Rule.UNKNOWN_FIRST,
        )

    def state(self) -> dict[str, dict[str, Any]]:
        """The policy's memory, for the state database."""
        return {
            f"{unit}{_HOST_SEPARATOR}{host}" if host else unit: {
                "fingerprint": s.fingerprint,
                "count": s.count,
                "ran_s": s.ran_s,
                "crashes": s.crashes,
            }
            for (host, unit), s in self._streaks.items()
            if unit
        }

    def forget(self, unit: str) -> None:
        """Drop a unit's memory, on every host (after `release`)."""
        for key in [key for key in self._streaks if key[1] == unit]:
            del self._streaks[key]


# Endings that are a cause's own record: a core dump (the crash inside), and systemd's own
# kill of a start or a watchdog that ran out of time (the same load takes as long again).
_ENDINGS_THAT_NAME_A_CAUSE = frozenset({"timeout", "watchdog", "core-dump"})


def names_no_cause(invocation: Invocation, verdict: Verdict) -> bool:
    """No error line of the invocation names its cause: the classifier's root cause is a
    guess, a wrapper that points elsewhere, a warning or systemd's exit record (low
    confidence), its words lean nowhere, and the ending is no cause's own record either."""
    return (
        verdict.confidence is Confidence.LOW
        and verdict.leaning is not Severity.FATAL
        and invocation.exit_code != "dumped"
        and invocation.result not in _ENDINGS_THAT_NAME_A_CAUSE
    )


def _as_dry_run(decision: Decision) -> Decision:
    """The decision as dry run reports it: marked, and a halt (a hold) says it would halt
    (hold)."""
    reason = decision.reason
    if decision.action in (Action.HALT, Action.HOLD):
        reason = f"dry run, would {decision.action.value}: {reason}"
    return dataclasses.replace(decision, reason=reason, dry_run=True)


def _gpu_fault(xid: GpuXid, streak: _Streak) -> Decision:
    """The kernel's Xid for the crash's GPU decides: hardware, not the unit's software
    streak. A reset or a reboot needed halts (the halt lifts after a reboot); NVIDIA's
    "restart the application" restarts (and pacing bounds a loop of them)."""
    streak.fingerprint, streak.count = None, 0
    said = f"GPU {xid.pci} logged Xid {xid.code} ({xid.meaning}) just before the crash"
    if xid.restart_helps:
        return Decision(
            action=Action.ALLOW_RESTART,
            reason=f"{said}: NVIDIA's action is to {xid.what_to_do}",
            rule=Rule.GPU_XID,
        )
    return Decision(
        action=Action.HALT,
        reason=f"{said}: a restart cannot get past it; {xid.what_to_do}",
        rule=Rule.GPU_XID,
    )


def _said_lost(decision: Decision, invocation: Invocation, verdict: Verdict) -> Decision:
    """A crash decided on a log journald cut says so: the cause may be in the lost lines."""
    if decision.action is Action.OBSERVE or verdict.severity is not Severity.UNKNOWN:
        return decision
    lost = invocation.lines_lost()
    if lost is None:
        return decision
    return dataclasses.replace(decision, reason=f"{decision.reason}; {lost}")


def _observe(rule: Rule, reason: str) -> Decision:
    return Decision(action=Action.OBSERVE, reason=reason, rule=rule)


def _about_the_same(first: float | None, second: float | None) -> bool:
    """Two times to crash that a repeated cause explains: within a factor, or a few seconds."""
    if first is None or second is None:
        return False
    low, high = sorted((first, second))
    return high - low <= SAME_TIME_SLACK_S or low * SAME_TIME_FACTOR >= high


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f} s"


def _silent_fingerprint(invocation: Invocation) -> str:
    """A crash with no root-cause line is known by how it ended."""
    return f"exit:{invocation.exit_code}:{invocation.exit_status}:{invocation.result}"
