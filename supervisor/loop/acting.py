"""Deciding and acting, in the unit's lane: evidence, decide, act, record as taken.

The lane (supervisor.actions.lanes) hands a unit's jobs over in the order their invocations
ended. For each ended invocation the hooks fill its evidence (the drift since the last good
start, the port's holder; they may wait), then the pipeline decides, once, on the reading and
the evidence (the same `Pipeline.decide` that `triage` runs); the decisions are noted with
the policy's memory, carried out by the actor (confirmed with systemd first), logged, and then
all of them are recorded as taken in one commit, which also queues their messages and clears
their pending records (supervisor.loop.checkpoint). A job may also be an outcome decided
before a restart: it is only acted on. Whoever waits for a job's outcome as recorded
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
from ..model import Ended, Ending, Outcome, Taken
from ..pipeline import Pipeline
from ..records import Pending
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
    """An ended invocation (or an outcome decided before a restart) in its unit's lane: what
    was known of this host when it ended, and where the outcome as recorded goes
    (`handle_batch`, `end_hung` wait for it; the live loop does not)."""

    pending: Pending
    here: Here
    recorded: asyncio.Future[Outcome]


class Acting:
    """The lanes' handler: decides one unit's jobs, carries them out, records them as taken."""

    def __init__(
        self,
        *,
        pipeline: Pipeline,
        actor: Actor | None,
        hooks: Sequence[BatchHook],
        checkpointer: Checkpointer,
        metrics: Metrics,
        state: LoopState,
        status: Callable[[], None],
        wake_sinks: Callable[[], None],
        held: Callable[[str], None] = lambda unit: None,
    ) -> None:
        """`held` is told of each unit whose start was held (pacing)."""
        self._held = held
        self._pipeline = pipeline
        self._actor = actor
        self._hooks = tuple(hooks)
        self._checkpointer = checkpointer
        self._metrics = metrics
        self._state = state
        self._status = status
        self._wake_sinks = wake_sinks

    async def carry_out(self, unit: str, jobs: list[Job]) -> None:
        """Decide, act on and record `unit`'s jobs, in the order they ended."""
        # Decisions are committed with what was done (or by any earlier commit): a supervisor
        # killed before finds the invocation still pending, and decides it again on the memory
        # committed with the record, which does not hold this decision yet.
        decided = [await self._decided(job.pending) for job in jobs]
        outcomes = [
            await self._act(outcome, job.here) for job, outcome in zip(jobs, decided, strict=True)
        ]
        self._checkpointer.taken(outcomes)
        await self._checkpointer.commit()
        _say_backlog(outcomes)
        self._wake_sinks()
        for job, outcome in zip(jobs, outcomes, strict=True):
            if not job.recorded.done():
                job.recorded.set_result(outcome)

    async def _decided(self, pending: Pending) -> Outcome:
        """The outcome of an ended invocation, decided on its evidence (noted with the policy's
        memory after it); an outcome decided before a restart as it is."""
        if not isinstance(pending, Ended):
            return pending
        evidence = self._pipeline.evidence(pending)
        for hook in self._hooks:
            try:
                evidence = await hook.evidence(pending, evidence)
            except Exception as exc:  # a hook's bug never costs the decision
                self._metrics.state_error("other")
                log.error(
                    "evidence_hook_failed",
                    hook=name_of(hook),
                    unit=pending.invocation.unit,
                    error=f"{type(exc).__name__}: {exc}",
                )
        outcome = self._pipeline.decide(pending, evidence)
        self._checkpointer.decided([outcome], self._pipeline.memory())
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
        if outcome.taken is Taken.HELD and outcome.invocation.unit is not None:
            self._held(outcome.invocation.unit)
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
