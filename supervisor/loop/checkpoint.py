"""Checkpointing: what the daemon decided and did, committed with the cursor that covers it.

Vector's Checkpointer and Finalizer split, with SQLite's transaction as the finalizer: the
loop notes each batch's ended invocations together with the checkpoint that covers them
(`ended`, synchronously, so no other task sees a cursor past invocations not yet noted), each
lane notes its decisions with the policy's memory after them (`decided`) and what its actions
did (`taken`), and `commit` writes everything noted so far in one transaction
(supervisor.store). Commits run one at a time, in the state writer's thread (SQLite's fsync on a
slow disk must not stall the gates or the watchdog); whoever waits for the running one finds its
own notes committed by the next: group commit.

A batch that decided nothing leaves its cursor to a quiet checkpoint at most
`checkpoint_interval_s` later (`run_quiet`). A failed commit (disk full) keeps every note and
is retried with capped backoff (`run_retry`); meanwhile the daemon goes on classifying, halting
and alerting from memory, and the cursor does not move, so a crash then only reads the batch
again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from ..errors import StateError
from ..model import Ended, Outcome
from ..seams import Notifying
from ..store import Checkpoint, Store
from ..telemetry.metrics import Metrics
from ..util.aio import first_of
from ..util.retry import Backoff

log = structlog.get_logger(__name__)

COMMIT_RETRY_S = 0.25  # first wait before retrying a failed state commit (doubles, capped)


@dataclass(frozen=True, slots=True, kw_only=True)
class Position:
    """Where reading resumes and the policy's memory, as of the last decisions noted."""

    checkpoint: Checkpoint
    memory: dict[str, dict[str, Any]]


class Checkpointer:
    """Notes decisions and what was done about them; commits them with their position."""

    def __init__(
        self,
        store: Store,
        metrics: Metrics,
        *,
        notifier: Notifying | None,
        interval_s: float,
        retry_max_s: float,
        position: Position,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.notifier = notifier
        self._metrics = metrics
        self.interval_s = interval_s
        self._retry = Backoff(COMMIT_RETRY_S, max(COMMIT_RETRY_S, retry_max_s))
        self._clock = clock
        self.position = position
        self.committed = position.checkpoint  # the last checkpoint the database holds
        self.undecided: list[Ended] = []  # ended, to be decided, not yet committed
        self.decisions: list[Outcome] = []  # decided, pending action, not yet committed
        self.pending: list[Outcome] = []  # taken, not yet committed (history, messages)
        self.messages: list[Outcome] = []  # messages only, not yet committed (no history)
        self.commit_error: str | None = None  # why the last commit failed; None once one succeeds
        self.state_errors = 0
        self._lock = asyncio.Lock()
        self._committed_at = 0.0
        self._uncommitted = asyncio.Event()  # set when a commit failed
        self._behind = asyncio.Event()  # set when a position was left uncommitted

    def ended(self, items: Sequence[Ended], checkpoint: Checkpoint | None) -> None:
        """Note a batch's ended invocations and the checkpoint that covers them (None: the
        checkpoint stands, e.g. while the journal is read again up to the saved cursor)."""
        self.undecided += items
        if checkpoint is not None:
            self.position = Position(checkpoint=checkpoint, memory=self.position.memory)

    def decided(self, outcomes: Sequence[Outcome], memory: dict[str, dict[str, Any]]) -> None:
        """Note decisions and the policy's memory after them (a lane decided them)."""
        self.decisions += outcomes
        self.position = Position(checkpoint=self.position.checkpoint, memory=memory)

    def taken(self, outcomes: Sequence[Outcome]) -> None:
        """Note what was done about decided outcomes: their history and messages."""
        self.pending += outcomes

    def told(self, outcomes: Sequence[Outcome]) -> None:
        """Note messages that are no invocation's crash (a paced unit serves again): queued
        with the next commit, kept out of history."""
        self.messages += outcomes

    async def commit(self, *, force: bool = False) -> bool:
        """Commit what is noted (only a position: at most every `interval_s` unless `force`);
        False when the commit failed (it is retried) or was left for later."""
        async with self._lock:
            return await self._commit(force=force)

    async def _commit(self, *, force: bool) -> bool:
        noted = bool(self.undecided or self.decisions or self.pending or self.messages)
        noted = noted or self.commit_error is not None
        if not (force or noted) and self._clock() - self._committed_at < self.interval_s:
            # Nothing was decided: the cursor alone can wait (see run_quiet). Entries read
            # again after a kill only rebuild the open invocation; every decision is committed
            # at once, with the cursor that covers it.
            self._behind.set()
            return False
        ended, decisions, pending = list(self.undecided), list(self.decisions), list(self.pending)
        position = self.position
        messages = list(self.messages)
        told = [*pending, *messages]
        writers = [self.notifier.writer_for(o) for o in told] if self.notifier else []
        try:
            await self.store.acommit_batch(
                checkpoint=position.checkpoint,
                ended=ended,
                decided=decisions,
                outcomes=pending,
                unit_states=position.memory,
                whole_memory=True,  # the pipeline's whole memory: a released unit forgotten
                extra=writers,
            )
        except StateError as exc:
            self._failed(exc)
            return False
        if self.commit_error is not None:
            committed = len(pending) + len(decisions) + len(ended)
            log.info("state_commit_recovered", committed=committed)
            self.commit_error = None
        del self.undecided[: len(ended)]
        del self.decisions[: len(decisions)]
        del self.pending[: len(pending)]
        del self.messages[: len(messages)]
        self.committed = position.checkpoint
        self._committed_at = self._clock()
        return True

    def _failed(self, exc: StateError) -> None:
        """Keep classifying, halting and alerting; hold the notes and retry the commit.

        The cursor does not move, so nothing is lost even if the daemon dies meanwhile: the
        batch is read again. The error is logged once per outage, counted every time.
        """
        self.state_errors += 1
        self._metrics.state_error("commit_failed")
        if self.commit_error is None:
            log.error(
                "state_commit_failed",
                error=str(exc),
                pending=len(self.pending) + len(self.decisions) + len(self.undecided),
                action="still classifying, halting and alerting; retrying the commit",
            )
        self.commit_error = str(exc)
        self._uncommitted.set()
        if self.notifier is not None:
            for outcome in self.pending:
                self.notifier.hold(outcome)

    async def run_quiet(self, stop: asyncio.Event) -> None:
        """Commit a position that batches left uncommitted once the journal goes quiet.

        It sleeps until a batch leaves its position uncommitted, so an idle daemon has no timer
        of its own (only the watchdog's pings); then at most `interval_s` later it is committed.
        """
        while not stop.is_set():
            await first_of(self._behind.wait(), stop.wait())
            if stop.is_set():
                return
            left = self.interval_s - (self._clock() - self._committed_at)
            if left > 0:
                await first_of(stop.wait(), at_most_s=left)
                continue
            self._behind.clear()
            if self.position.checkpoint != self.committed:
                await self.commit(force=True)

    async def run_retry(self, stop: asyncio.Event, *, on_recovered: Callable[[], None]) -> None:
        """Retry a failed commit with capped backoff, also while the journal is quiet;
        `on_recovered` once notes that waited are committed (the sinks have news)."""
        failures = 0  # retries in this outage
        while not stop.is_set():
            if self.commit_error is None:
                failures = 0
                self._uncommitted.clear()
                await first_of(self._uncommitted.wait(), stop.wait())
                continue
            failures += 1
            await first_of(stop.wait(), at_most_s=self._retry.delay(failures))
            if self.commit_error is not None and not stop.is_set():
                had = bool(self.pending)
                if await self.commit() and had:
                    on_recovered()
