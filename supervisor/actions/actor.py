"""Carry out a decision: the one place that halts, restarts, or only records.

The policy says what should happen to a unit whose crash is the present one. The actor asks
systemd whether it is (supervisor.actions.presence), then:

- halt, present (or down, with nothing restarting it: a timer or a person starts it again):
  quarantine (the gate's record), then StopUnit unless the unit is down already or its gate
  is waiting on us (the gate refuses the start itself: a StopUnit then would kill
  the gate and fail the unit);
- hold (a paced loop): the hold record with its deadline, which the unit's gate turns into a
  refused start and a systemd timer that starts the unit at the deadline (supervisor.actions
  .holds); a unit nothing would restart (RemainAfterExit=, an exit 0 under Restart=on-failure)
  is restarted into its gate, which holds it; a hold that cannot be written restarts at
  systemd's pace, as before pacing;
- allow-restart: nothing, systemd restarts it; but a hung engine (the unit stays active) and a
  crash that exited 0 (systemd sees success and, under `Restart=on-failure`, leaves it down)
  are restarted here;
- not present (read late, another host, an earlier boot): recorded, never acted on;
- dry run: everything above is only said.

The result is the outcome as recorded: `taken` says what was done, and a late crash's decision
becomes `observe` with the reason, so history and Slack never claim an action that did not
happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import assert_never

import structlog

from ..errors import SystemdError
from ..model import Action, Decision, Ending, Outcome, Rule, Taken, UnitState, duration
from ..seams import UnitStateSource
from ..telemetry.metrics import Metrics
from ..util.aio import Nursery
from ..util.when import clock_time
from .halt import Halter, HaltResult
from .holds import Hold, Holds
from .presence import Here, Judgement, Presence, judge

log = structlog.get_logger(__name__)

STATE_TIMEOUT_S = 5.0
GATE_WATCH_S = 120.0  # how long a gate that has not asked us is watched
GATE_POLL_S = 0.05


class Actor:
    """Turns decided outcomes into actions on systemd, each confirmed first."""

    def __init__(
        self,
        halter: Halter,
        systemd: UnitStateSource | None,
        metrics: Metrics,
        *,
        gate_waiting: Callable[[str], bool] = lambda unit: False,
        state_timeout_s: float = STATE_TIMEOUT_S,
        holds: Holds | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """`holds` is where held starts are recorded; None: holds restart at systemd's pace."""
        self.halter = halter
        self._holds = holds
        self._wall = wall
        self._systemd = systemd
        self._metrics = metrics
        self._gate_waiting = gate_waiting
        self._state_timeout_s = state_timeout_s
        self._watches = Nursery()  # gates left to watch after a halt

    async def run(self, stop: asyncio.Event) -> None:
        """Hold the watches of gates left after halts, until `stop` (the daemon runs this)."""
        await self._watches.run(stop)

    async def carry_out(self, outcome: Outcome, here: Here) -> Outcome:
        """Act on `outcome` if it is the present one; the outcome as it is to be recorded."""
        decision, unit = outcome.decision, outcome.invocation.unit
        if decision.action is Action.OBSERVE or unit is None:
            return _taken(outcome, Taken.OBSERVED, "")
        judgement = judge(outcome.invocation, await self._state(unit), here)
        if not judgement.actable and judgement.presence is not Presence.DOWN:
            return _history(outcome, judgement)
        match decision.action:
            case Action.HALT:
                return await self._halt(unit, outcome, judgement)
            case Action.HOLD:
                return await self._hold(unit, outcome, judgement)
            case Action.ALLOW_RESTART:
                return await self._allow_restart(unit, outcome, judgement)
        assert_never(decision.action)

    async def _hold(self, unit: str, outcome: Outcome, judgement: Judgement) -> Outcome:
        decision = outcome.decision
        pace = decision.pace
        delay_s = pace.delay_s if pace is not None else 0.0
        if decision.dry_run:
            return _taken(
                outcome,
                Taken.WOULD_HALT,
                f"dry run: would hold its next start {duration(delay_s)} ({judgement.reason})",
            )
        if self._holds is None:
            return await self._allow_restart(unit, outcome, judgement)
        now = self._wall()
        hold = Hold(
            unit=unit,
            until=now + delay_s,
            since=now,
            crashes=pace.crashes if pace is not None else 0,
            reason=decision.reason,
            rule=decision.rule.value,
            invocation_id=outcome.invocation.invocation_id,
            signature=outcome.verdict.signature,
        )
        try:
            begins = self._holds.read(unit) is None  # no hold stands: pacing begins (again)
            await self._holds.write(hold)
        except OSError as exc:
            log.error("hold_failed", unit=unit, error=str(exc))
            restarted = await self._allow_restart(unit, outcome, judgement)
            return _taken(
                restarted,
                restarted.taken,
                f"the hold could not be written ({exc.strerror}): {restarted.taken_detail}",
            )
        self._metrics.held(unit, decision.rule, hold.until)
        until = clock_time(hold.until)
        detail = f"next start held until {until} ({duration(delay_s)}; {judgement.reason})"
        log.warning(
            "unit_held",
            unit=unit,
            invocation_id=outcome.invocation.invocation_id,
            until=until,
            crashes=hold.crashes,
            rule=decision.rule.value,
            action=f"its gate refuses starts until {until}; systemd starts it then",
        )
        restarted = await self._allow_restart(unit, outcome, judgement)
        if restarted.taken is Taken.RESTARTED:
            detail = f"{detail}; restarted into its gate, which holds it"
        elif restarted.taken is Taken.DOWN:
            detail = f"{detail}; {restarted.taken_detail}"
        if pace is not None:
            decision = dataclasses.replace(decision, pace=dataclasses.replace(pace, begins=begins))
            outcome = dataclasses.replace(outcome, decision=decision)
        return _taken(outcome, Taken.HELD, detail)

    async def _halt(self, unit: str, outcome: Outcome, judgement: Judgement) -> Outcome:
        # A unit that nothing restarts (Restart=no) is still started again by a timer, a
        # dependency or a person: the record keeps each such start of a fatal crash off, and
        # the crash is told once. There is nothing to stop.
        if outcome.decision.dry_run:
            return _taken(
                outcome,
                Taken.WOULD_HALT,
                f"dry run: would quarantine {unit}{' and stop it' if judgement.running else ''}"
                f" ({judgement.reason})",
            )
        # A StopUnit while the next start's gate runs would kill the gate and fail the unit: the
        # gate reads the record itself. One that connects late (a Python starting) is checked
        # on once it is done, beside the unit's lane (its gate's answer waits for the lane).
        gate = self._gate_waiting(unit) or judgement.gating
        result = await self.halter.halt(unit, outcome, stop=judgement.running and not gate)
        if judgement.gating and not self._gate_waiting(unit):
            self._watch_gate(unit)
        return self._halted(unit, outcome, judgement, result)

    def _watch_gate(self, unit: str) -> None:
        self._watches.start(lambda: self._after_gate(unit), name=f"gate watch {unit}")

    async def _after_gate(self, unit: str) -> None:
        """Once the gate is done: stop the unit if it let the start through anyway (not our
        gate, or a record it could not read), as the halt intended."""
        deadline = asyncio.get_running_loop().time() + GATE_WATCH_S
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(GATE_POLL_S)  # polling systemd: no event tells it here
            state = await self._state(unit)
            if state is None or state.sub_state in ("condition", "auto-restart"):
                continue  # the gate runs, or is still to run at the pending restart
            if state.active_state in ("active", "activating"):
                log.warning("gate_let_start_through", unit=unit, action="stopping it")
                with contextlib.suppress(SystemdError):
                    await self.halter.stop(unit)
            return

    def _halted(
        self, unit: str, outcome: Outcome, judgement: Judgement, result: HaltResult
    ) -> Outcome:
        detail = f"{result.detail} ({judgement.reason})"
        verdict, inv = outcome.verdict, outcome.invocation
        said = {
            "unit": unit,
            "invocation_id": inv.invocation_id,
            "signature": verdict.signature,
            "severity": verdict.severity.value,
            "root_cause": verdict.root_cause,
            "rule": outcome.decision.rule.value,
            "detail": detail,
            "release": f"vllm-supervisor release {unit}",
        }
        if result.repeat_of is not None:
            # Told already: this crash joins the story of the halt that stands.
            outcome = dataclasses.replace(outcome, already_halted_by=result.repeat_of)
            if result.quarantined is not None and result.failure_reason is None:
                log.info("crash_while_halted", halted_by=result.repeat_of, **said)
                taken = Taken.HALTED if result.complete else Taken.QUARANTINED
                return _taken(outcome, taken, f"already halted by {result.repeat_of}: {detail}")
        if result.complete:
            self._metrics.halt(unit, outcome.decision.rule, result.latency_s)
            log.warning("unit_halted", action="halt", taken=Taken.HALTED.value, **said)
            return _taken(outcome, Taken.HALTED, detail)
        reason = result.failure_reason
        if reason is not None:
            self._metrics.halt_failed(unit, reason)
        if result.quarantined is not None:
            self._metrics.units_halted(unit, True)
            if reason is None:  # systemd control is off: the quarantine is the whole halt
                log.warning("unit_halted", action="halt", taken=Taken.QUARANTINED.value, **said)
            else:
                log.error("halt_failed", taken=Taken.QUARANTINED.value, **said)
            return _taken(outcome, Taken.QUARANTINED, detail)
        log.error("halt_failed", taken=Taken.HALT_FAILED.value, **said)
        return _taken(outcome, Taken.HALT_FAILED, detail)

    async def _allow_restart(self, unit: str, outcome: Outcome, judgement: Judgement) -> Outcome:
        invocation = outcome.invocation
        if invocation.ending is Ending.HUNG and judgement.presence is Presence.CURRENT:
            why = "its engine died while the unit stayed up"
        elif judgement.remains:
            why = "its server exited, the unit stays active (RemainAfterExit=): nothing restarts it"
        elif judgement.presence is Presence.DOWN and invocation.result == "success":
            why = "it exited 0 after crashing, so systemd will not restart it"
        elif judgement.presence is Presence.DOWN:
            return _taken(outcome, Taken.DOWN, f"the server is down: {judgement.reason}")
        else:
            return _taken(outcome, Taken.RESTARTING, judgement.reason)
        if outcome.decision.dry_run:
            return _taken(outcome, Taken.WOULD_HALT, f"dry run: would restart {unit}: {why}")
        if not self.halter.controls_systemd:
            return _taken(outcome, Taken.DOWN, f"not restarted ({why}): systemd control is off")
        try:
            await self.halter.restart(unit)
        except SystemdError as exc:
            log.error("restart_failed", unit=unit, reason=exc.reason, error=str(exc))
            return _taken(outcome, Taken.RESTART_FAILED, f"could not restart it ({why}): {exc}")
        return _taken(outcome, Taken.RESTARTED, f"restarted it: {why}")

    async def state(self, unit: str) -> UnitState | None:
        """systemd's view of the unit, or None when it cannot be asked."""
        return await self._state(unit)

    async def _state(self, unit: str) -> UnitState | None:
        """systemd's view of the unit, or None when it cannot be asked (journal alone)."""
        if self._systemd is None:
            return None
        try:
            async with asyncio.timeout(self._state_timeout_s):
                return await self._systemd.unit_state(unit)
        except (SystemdError, TimeoutError) as exc:
            log.warning("unit_state_unavailable", unit=unit, error=str(exc) or "timeout")
            return None


_HISTORY_RULES = {
    Presence.LATE: Rule.LATE,
    Presence.OTHER_HOST: Rule.OTHER_HOST,
    Presence.PREVIOUS_BOOT: Rule.PREVIOUS_BOOT,
}


def _taken(outcome: Outcome, taken: Taken, detail: str) -> Outcome:
    return dataclasses.replace(outcome, taken=taken, taken_detail=detail)


def _history(outcome: Outcome, judgement: Judgement) -> Outcome:
    """A crash that is not the present one: the decision becomes 'observe', with why."""
    decision = outcome.decision
    said = f"{decision.action.value}: {decision.reason}"
    recorded = Decision(
        action=Action.OBSERVE,
        reason=f"{judgement.reason}; recorded, not acted on (for the present it would be {said})",
        dry_run=decision.dry_run,
        rule=_HISTORY_RULES.get(judgement.presence, Rule.OTHER),
    )
    return dataclasses.replace(
        outcome, decision=recorded, taken=Taken.RECORDED, taken_detail=judgement.reason
    )
