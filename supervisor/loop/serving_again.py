"""A paced unit that serves again: its hold ends, and that is told once.

Pacing begins with one message (supervisor.notify.decision); the held crashes after it are told
by it. What ends the story is the unit serving again: the first serving line of a paced unit's
run removes its hold record (its time had passed: the gate let the start through) and queues
one message, committed with the next batch like any other. The message is no invocation's
crash: it is kept out of history, and its dedupe key is its run's, marked, so the same run's
crash later is still told.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import structlog

from ..actions.holds import Hold, Holds
from ..model import Action, Decision, Invocation, Outcome, Rule, Severity, Taken, Verdict, duration

log = structlog.get_logger(__name__)

SERVING_SUFFIX = ":serving-again"


class ServingAgain:
    """Which units are paced, and which of them serves again."""

    def __init__(self, holds: Holds) -> None:
        self._holds = holds
        try:
            self._paced = set(holds.all())  # the holds a previous run of the daemon left
        except OSError as exc:
            log.warning("hold_records_unreadable", error=str(exc))
            self._paced = set()

    def held(self, unit: str) -> None:
        """A start of `unit` was held (the actor wrote its hold)."""
        self._paced.add(unit)

    def released(self, unit: str) -> None:
        """A person ended the hold (`release`): there is nothing left to tell."""
        self._paced.discard(unit)

    def check(self, open_run: Callable[[str], Invocation | None]) -> list[Outcome]:
        """The messages of the paced units whose open run serves now; their holds removed."""
        told = []
        for unit in sorted(self._paced):
            run = open_run(unit)
            if run is None or not run.served:
                continue
            self._paced.discard(unit)
            try:
                hold = self._holds.remove(unit)
            except OSError as exc:
                log.warning("hold_not_removed", unit=unit, error=str(exc))
                continue
            if hold is None:
                continue  # released meanwhile, or never written
            log.info(
                "unit_serves_again",
                unit=unit,
                invocation_id=run.invocation_id,
                crashes=hold.crashes,
                action="pacing ended: its next crash starts a new count",
            )
            told.append(serving_again(run, hold))
        return told


def serving_again(run: Invocation, hold: Hold) -> Outcome:
    """The message's subject: the run that serves, and the hold it ended."""
    paced_s = max(0.0, (run.served_us or run.started_us or 0) / 1e6 - hold.since)
    reason = (
        f"serves again after {hold.crashes} crashes in a row, paced for {duration(paced_s)} "
        f"({hold.rule or 'unknown rule'}); its hold has ended, and a hold after its next "
        "crash is told as pacing that begins again"
    )
    invocation = dataclasses.replace(
        run,
        invocation_id=f"{run.invocation_id}{SERVING_SUFFIX}",
        lines=(),
        ended_us=run.served_us,
    )
    return Outcome(
        invocation=invocation,
        verdict=Verdict(
            signature=hold.signature,
            severity=Severity.UNKNOWN,
            title="Serving again",
            root_cause=None,
            crashed=False,
        ),
        decision=Decision(action=Action.OBSERVE, reason=reason, rule=Rule.SERVING_AGAIN),
        taken=Taken.OBSERVED,
        taken_detail="its hold ended",
    )
