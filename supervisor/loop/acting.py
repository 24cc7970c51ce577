"""Acting on decided outcomes, in their unit's lane: enrich, act, record as taken.

The lane (supervisor.actions.lanes) hands a unit's jobs over in the order decided. Each outcome
is enriched by the hooks (the drift since the last good start, the port's holder; they may
wait), carried out by the actor (confirmed with systemd first), logged, and then all of them
are recorded as taken in one commit, which also queues their messages and clears their pending
actions (supervisor.loop.checkpoint). Whoever waits for a job's outcome as recorded
(`Job.recorded`: a hand-driven batch, a hung engine) gets it after that commit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import structlog

from ..actions.actor import Actor
from ..actions.presence import Here
from ..model import Ending, Outcome, Taken
from ..seams import BatchHook, StatusReporter
from ..telemetry.metrics import Metrics
from ..util.aio import name_of
from .checkpoint import Checkpointer

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class LoopState:
    """What the daemon has seen so far, for STATUS= and /healthz."""

    entries: int = 0
    outcomes: int = 0
    halts: int = 0
    last_verdict: str = "none yet"
    not_reloaded: list[str] = field(default_factory=list)  # what waits for a restart


@dataclass(frozen=True, slots=True)
class Job:
    """A decided outcome in its unit's lane: what was known when it was decided, and where the
    outcome as recorded goes (`handle_batch`, `end_hung` wait for it; the live loop does not)."""

    outcome: Outcome
    here: Here
    recorded: asyncio.Future[Outcome]


class Acting:
    """The lanes' handler: carries out one unit's jobs and records them as taken."""

    def __init__(
        self,
        *,
        actor: Actor | None,
        hooks: Sequence[BatchHook],
        checkpointer: Checkpointer,
        metrics: Metrics,
        state: LoopState,
        status: Callable[[], None],
        wake_sinks: Callable[[], None],
    ) -> None:
        self._actor = actor
        self._hooks = tuple(hooks)
        self._checkpointer = checkpointer
        self._metrics = metrics
        self._state = state
        self._status = status
        self._wake_sinks = wake_sinks

    async def carry_out(self, unit: str, jobs: list[Job]) -> None:
        """Enrich, act on and record `unit`'s jobs, in the order decided."""
        outcomes = [await self._act(await self._enrich(job.outcome), job.here) for job in jobs]
        self._checkpointer.taken(outcomes)
        await self._checkpointer.commit()
        _say_backlog(outcomes)
        self._wake_sinks()
        for job, outcome in zip(jobs, outcomes, strict=True):
            if not job.recorded.done():
                job.recorded.set_result(outcome)

    async def _enrich(self, outcome: Outcome) -> Outcome:
        """What the hooks add to a decided outcome (drift, the port's holder)."""
        for hook in self._hooks:
            try:
                outcome = await hook.outcome(outcome)
            except Exception as exc:  # a hook's bug never costs the action
                self._metrics.state_error("other")
                log.error(
                    "outcome_hook_failed",
                    hook=name_of(hook),
                    unit=outcome.invocation.unit,
                    error=f"{type(exc).__name__}: {exc}",
                )
        return outcome

    async def _act(self, outcome: Outcome, here: Here) -> Outcome:
        """Carry out the decision (the actor confirms it with systemd); the outcome as recorded."""
        self._state.outcomes += 1
        if self._actor is not None:
            try:
                outcome = await self._actor.carry_out(outcome, here)
            except Exception as exc:
                self._metrics.state_error("other")
                log.error(
                    "action_failed",
                    unit=outcome.invocation.unit,
                    invocation_id=outcome.invocation.invocation_id,
                    cursor=outcome.invocation.last_cursor,
                    error=f"{type(exc).__name__}: {exc}",
                )
        if outcome.taken is Taken.HALTED:
            self._state.halts += 1
        verdict = outcome.verdict
        self._state.last_verdict = (
            f"{outcome.invocation.unit}: {verdict.signature or verdict.severity}"
        )
        _say_ended(outcome)
        self._status()
        return outcome


def report_status(reporter: StatusReporter | None, units: Sequence[str], state: LoopState) -> None:
    """Tell systemd (STATUS=) what the daemon follows and has done; never fails the caller."""
    if reporter is None:
        return
    following = ",".join(units) or "all units"
    with contextlib.suppress(Exception):
        reporter.status(
            f"following {following}; {state.outcomes} invocations classified, "
            f"{state.halts} halts; last: {state.last_verdict}"
        )


def _say_ended(outcome: Outcome) -> None:
    verdict, decision, inv = outcome.verdict, outcome.decision, outcome.invocation
    log.info(
        "invocation_ended",
        unit=inv.unit,
        invocation_id=inv.invocation_id,
        host=inv.hostname,
        ending=inv.ending.value,
        signature=verdict.signature,
        severity=verdict.severity.value,
        root_cause=verdict.root_cause,
        action=decision.action.value,
        rule=decision.rule,
        reason=decision.reason,
        taken=outcome.taken.value,
        detail=outcome.taken_detail,
        dry_run=decision.dry_run,
    )
    if inv.ending is Ending.SKIPPED and outcome.taken is not Taken.RECORDED:
        log.info(
            "start_refused",
            unit=inv.unit,
            invocation_id=inv.invocation_id,
            action="the gate skipped the start: the unit is quarantined",
        )


def _say_backlog(outcomes: list[Outcome]) -> None:
    """One line per unit for the crashes that were read late (recorded, not acted on)."""
    late: dict[str, int] = {}
    for outcome in outcomes:
        if outcome.taken is Taken.RECORDED and outcome.invocation.unit is not None:
            late[outcome.invocation.unit] = late.get(outcome.invocation.unit, 0) + 1
    for unit, count in sorted(late.items()):
        log.info(
            "backlog_recorded",
            unit=unit,
            count=count,
            action="recorded in history, not acted on: they ended before the supervisor read them",
        )
