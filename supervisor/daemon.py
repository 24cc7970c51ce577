"""The live daemon: the pipeline plus actions, checkpoints and a bounded shutdown.

`Daemon.run(stop, reload)` knows nothing about OS signals (the CLI turns SIGTERM into `stop` and
SIGHUP into `reload`), so tests embed it directly.

Per batch of journal entries: track and classify (pure), halt what must be halted (quarantine
first, then StopUnit, as early as possible), then commit the cursor, history, policy memory and
queued notifications in one transaction. A crash anywhere replays the batch from the previous
cursor; the store, the outbox and the quarantine are idempotent per invocation.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import structlog

from supervisor.aio import first_of
from supervisor.config import Config
from supervisor.errors import StateError
from supervisor.journal.reader import (
    JournalctlReader,
    ReaderSettings,
    cursor_realtime_us,
    resolve_source,
)
from supervisor.metrics import Metrics
from supervisor.model import Action, JournalEntry, Outcome
from supervisor.notify.slack import action_taken_for
from supervisor.pipeline import Pipeline
from supervisor.signatures import SignatureTable
from supervisor.store import Checkpoint, Store, Writer

log = structlog.get_logger(__name__)

SHUTDOWN_TIMEOUT_S = 8.0
COMMIT_RETRY_S = 0.25  # first wait before retrying a failed state commit (doubles, capped)


class Halting(Protocol):
    """Quarantines and stops a unit (supervisor.halt.Halter)."""

    async def halt(self, outcome: Outcome, *, dry_run: bool) -> object: ...


class Notifying(Protocol):
    """Queues and delivers notifications (supervisor.notify.outbox.Outbox)."""

    def writer_for(self, outcome: Outcome, *, action_taken: str) -> Writer: ...

    async def run(self, stop: asyncio.Event) -> None: ...

    def wake(self) -> None: ...

    def hold(self, outcome: Outcome, *, action_taken: str) -> None: ...


class BatchHook(Protocol):
    """Sees each batch before the pipeline and each outcome before it is acted on.

    `entries` is synchronous and pure (it may drop entries and note what it saw); `outcome` may
    await briefly to enrich an outcome (supervisor.hang, supervisor.drift).
    """

    def entries(self, batch: list[JournalEntry]) -> list[JournalEntry]: ...

    async def outcome(self, outcome: Outcome) -> Outcome: ...


class StatusReporter(Protocol):
    """Tells systemd how the daemon is (sd_notify)."""

    def ready(self) -> None: ...

    def status(self, text: str) -> None: ...


@dataclass(slots=True)
class DaemonState:
    """What the daemon has seen so far, for STATUS= and /healthz."""

    entries: int = 0
    outcomes: int = 0
    halts: int = 0
    last_verdict: str = "none yet"
    state_errors: int = 0
    pending: list[Outcome] = field(default_factory=list)
    commit_error: str | None = None  # why the last commit failed; None once one succeeds


class Daemon:
    """Follows the journal and acts on every ended invocation of the configured units."""

    def __init__(
        self,
        config: Config,
        table: SignatureTable,
        *,
        store: Store,
        metrics: Metrics,
        halter: Halting | None = None,
        notifier: Notifying | None = None,
        reporter: StatusReporter | None = None,
        load_table: Callable[[], SignatureTable] | None = None,
        extra_tasks: Sequence[Callable[[asyncio.Event], Coroutine[None, None, None]]] = (),
        hooks: Sequence[BatchHook] = (),
    ) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics
        self.halter = halter
        self.notifier = notifier
        self.reporter = reporter
        self.state = DaemonState()
        self._load_table = load_table
        self.extra_tasks = list(extra_tasks)  # supervisor.hang and .drift add theirs
        self.hooks: list[BatchHook] = list(hooks)
        # Held while a batch (or outcomes found outside one, a hung engine) is acted on and
        # committed, so a commit never saves a cursor past outcomes not yet recorded.
        self.lock = asyncio.Lock()
        self._ending = asyncio.Event()  # set when an ended invocation awaits its late lines
        self._uncommitted = asyncio.Event()  # set when a commit failed (disk full)
        self.checkpoint = store.load_checkpoint()
        self.pipeline = Pipeline(
            config, table, policy_state=store.load_unit_states(), observer=metrics.outcome
        )
        self.reader = JournalctlReader(
            self._reader_settings(),
            cursor=self.checkpoint.replay_from or self.checkpoint.cursor,
            inclusive=self.checkpoint.replay_from is not None,
            on_restart=metrics.source_restart,
            on_invalid=lambda n: metrics.entry_invalid("unparsable_entry"),
            on_following=metrics.following,
            on_gap=metrics.cursor_gap,
        )
        # Entries up to the saved cursor were handled before a restart: they only rebuild the
        # tracker's open invocation, nothing is decided about them again.
        self._replay_until = self.checkpoint.cursor if self.checkpoint.replay_from else None
        self._committed_at = 0.0  # time.monotonic() of the last successful commit
        metrics.register_units(u.name for u in config.units)
        metrics.signature_table([s.id for s in table.signatures], True)

    def _reader_settings(self) -> ReaderSettings:
        journal = self.config.journal
        start = journal.start_at
        if start == "auto":
            start = "head" if journal.directory is not None else "tail"
        return ReaderSettings(
            units=tuple(u.name for u in self.config.units),
            directory=journal.directory,
            journalctl=journal.journalctl,
            source=journal.reader,
            follow=True,
            start_at=start,
            on_bad_cursor=self.config.state.on_bad_cursor,
            backoff_s=journal.restart_backoff_s,
            backoff_max_s=journal.restart_backoff_max_s,
            max_line_chars=self.config.tracker.max_line_chars,
        )

    async def run(self, stop: asyncio.Event, reload: asyncio.Event | None = None) -> None:
        """Run until `stop` is set; SIGHUP-style reloads when `reload` is set."""
        reload = reload or asyncio.Event()
        log.info("supervisor_starting", units=[u.name for u in self.config.units])
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._watch_reload(stop, reload))
            tasks.create_task(self._announce_ready(stop))
            tasks.create_task(self._settle(stop))
            tasks.create_task(self._retry_commits(stop))
            tasks.create_task(self._checkpoint_quiet(stop))
            if self.notifier is not None:
                tasks.create_task(self.notifier.run(stop))
            for extra in self.extra_tasks:
                tasks.create_task(extra(stop))
            try:
                await self._follow(stop)
            finally:
                stop.set()
        log.info("supervisor_stopped", entries=self.state.entries, outcomes=self.state.outcomes)

    async def _follow(self, stop: asyncio.Event) -> None:
        async for batch in self.reader.batches(stop):
            await self.handle_batch(batch)
        self._commit([], force=True)

    async def handle_batch(self, batch: list[JournalEntry]) -> list[Outcome]:
        """Track, decide, act and checkpoint one batch of entries."""
        async with self.lock:
            return await self._handle_batch(batch)

    async def _handle_batch(self, batch: list[JournalEntry]) -> list[Outcome]:
        received = time.time()
        batch = self._skip_replayed(batch)
        for hook in self.hooks:
            batch = hook.entries(batch)
        outcomes = await self._enrich(self.pipeline.feed(batch))
        self.state.entries += len(batch)
        self.metrics.entries_read(len(batch))
        if batch:
            self.metrics.journal_lag(max(0.0, received - batch[-1].realtime_us / 1e6))
        outcomes = [await self._act(outcome) for outcome in outcomes]
        self._commit(outcomes)
        if outcomes and self.notifier is not None:
            self.notifier.wake()
        if self.pipeline.tracker.next_deadline_us() is not None:
            self._ending.set()
        return outcomes

    async def _settle(self, stop: asyncio.Event) -> None:
        """Decide ended invocations once their late-line window has passed.

        A later entry decides them too (see InvocationTracker.feed); this covers the quiet
        journal after a crash, where no later entry comes.
        """
        while not stop.is_set():
            deadline = self.pipeline.tracker.next_deadline_us()
            if deadline is None:
                self._ending.clear()
                await first_of(self._ending.wait(), stop.wait())
                continue
            delay = deadline / 1e6 - time.time()
            if delay > 0:
                await first_of(stop.wait(), at_most_s=delay)
                continue
            async with self.lock:
                outcomes = self.pipeline.flush_due(int(time.time() * 1e6))
                if outcomes:
                    await self.handle_outcomes(outcomes)

    async def handle_outcomes(self, outcomes: list[Outcome]) -> None:
        """Act on and commit outcomes decided outside a batch (a hung engine); hold `lock`."""
        outcomes = await self._enrich(outcomes)
        outcomes = [await self._act(outcome) for outcome in outcomes]
        self._commit(outcomes)
        if outcomes and self.notifier is not None:
            self.notifier.wake()

    async def _enrich(self, outcomes: list[Outcome]) -> list[Outcome]:
        for hook in self.hooks:
            outcomes = [await hook.outcome(o) for o in outcomes]
        return outcomes

    def _skip_replayed(self, batch: list[JournalEntry]) -> list[JournalEntry]:
        if self._replay_until is None:
            return batch
        if self.reader.cursor_rejected:
            # The saved cursor cannot be found (another journal, corrupt): there is nothing to
            # replay up to, and waiting for it would drop every batch from now on.
            log.warning("replay_abandoned", cursor=self._replay_until)
            self._replay_until = None
            return batch
        for index, entry in enumerate(batch):
            if _after(entry.cursor, self._replay_until):
                # The saved entry was vacuumed: this one is new, to be decided, not replayed.
                self._replay_until = None
                log.info("replay_done", cursor=entry.cursor)
                return batch[index:]
            self.pipeline.tracker.feed(entry)
            if entry.cursor == self._replay_until:
                self._replay_until = None
                log.info("replay_done", cursor=entry.cursor)
                return batch[index + 1 :]
        return []

    async def _act(self, outcome: Outcome) -> Outcome:
        """Log and carry out the decision; the outcome as recorded (a failed stop noted)."""
        self.state.outcomes += 1
        verdict, decision = outcome.verdict, outcome.decision
        self.state.last_verdict = (
            f"{outcome.invocation.unit}: {verdict.signature or verdict.severity}"
        )
        log.info(
            "invocation_ended",
            unit=outcome.invocation.unit,
            invocation_id=outcome.invocation.invocation_id,
            signature=verdict.signature,
            severity=verdict.severity.value,
            root_cause=verdict.root_cause,
            action=decision.action.value,
            reason=decision.reason,
            dry_run=decision.dry_run,
        )
        if decision.action is Action.HALT:
            self.state.halts += 1
            if self.halter is not None:
                outcome = await self._halt(outcome)
        self._report_status()
        return outcome

    async def _halt(self, outcome: Outcome) -> Outcome:
        assert self.halter is not None  # noqa: S101 - checked by the caller
        unit = outcome.invocation.unit or "unknown"
        result = await self.halter.halt(outcome, dry_run=outcome.decision.dry_run)
        if outcome.decision.dry_run:
            return outcome
        error = getattr(result, "error", None)
        if error is not None:
            reason = getattr(error, "reason", "dbus_error")
            self.metrics.halt_failed(unit, reason)
            # History and the Slack message say so: the decision stands, the stop did not
            # happen (the quarantine record, when written, still keeps the next start off).
            gate = "quarantined" if getattr(result, "quarantined", None) else "NOT quarantined"
            note = f"; stop failed ({reason}), {gate}: {error}"
            if getattr(result, "quarantined", None):
                self.metrics.units_halted(unit, True)
            return replace(
                outcome, decision=replace(outcome.decision, reason=outcome.decision.reason + note)
            )
        reason = "unknown_repeat" if outcome.verdict.signature is None else "fatal_signature"
        self.metrics.halt(unit, reason, float(getattr(result, "latency_s", 0.0)))
        self.metrics.units_halted(unit, True)
        return outcome

    def _commit(self, outcomes: list[Outcome], *, force: bool = False) -> None:
        self.state.pending += outcomes
        if self._replay_until is not None:
            return  # the saved cursor still stands until the replay passes it
        if not (force or self.state.pending or self.state.commit_error is not None) and (
            time.monotonic() - self._committed_at < self.config.state.checkpoint_interval_s
        ):
            # Nothing was decided: the cursor alone can wait (see _checkpoint_quiet). Entries
            # read again after a kill only rebuild the open invocation; every decision is
            # committed at once, with the cursor that covers it.
            return
        writers = [
            self.notifier.writer_for(o, action_taken=action_taken_for(o.decision))
            for o in self.state.pending
            if self.notifier is not None
        ]
        checkpoint = Checkpoint(
            cursor=self.reader.cursor, replay_from=self.pipeline.tracker.replay_from()
        )
        try:
            self.store.commit_batch(
                checkpoint=checkpoint,
                outcomes=self.state.pending,
                unit_states=self.pipeline.policy.state(),
                extra=writers,
            )
        except StateError as exc:
            self._commit_failed(exc)
            return
        if self.state.commit_error is not None:
            log.info("state_commit_recovered", committed=len(self.state.pending))
            self.state.commit_error = None
        self.checkpoint = checkpoint
        self.state.pending = []
        self._committed_at = time.monotonic()

    async def _checkpoint_quiet(self, stop: asyncio.Event) -> None:
        """Commit a cursor that batches left uncommitted once the journal goes quiet."""
        interval = self.config.state.checkpoint_interval_s
        while not stop.is_set():
            await first_of(stop.wait(), at_most_s=interval)
            if stop.is_set():
                return
            if time.monotonic() - self._committed_at < interval:
                continue
            async with self.lock:
                if self.reader.cursor != self.checkpoint.cursor:
                    self._commit([], force=True)

    def _commit_failed(self, exc: StateError) -> None:
        """Keep classifying, halting and alerting; hold the batch and retry its commit.

        The cursor does not move, so nothing is lost even if the daemon dies meanwhile: the
        batch is read again. The error is logged once per outage, counted every time.
        """
        self.state.state_errors += 1
        self.metrics.state_error("commit_failed")
        if self.state.commit_error is None:
            log.error(
                "state_commit_failed",
                error=str(exc),
                pending=len(self.state.pending),
                action="still classifying, halting and alerting; retrying the commit",
            )
        self.state.commit_error = str(exc)
        self._uncommitted.set()
        if self.notifier is not None:
            for outcome in self.state.pending:
                self.notifier.hold(outcome, action_taken=action_taken_for(outcome.decision))

    async def _retry_commits(self, stop: asyncio.Event) -> None:
        """Retry a failed commit with capped backoff, also while the journal is quiet."""
        delay = COMMIT_RETRY_S
        while not stop.is_set():
            if self.state.commit_error is None:
                delay = COMMIT_RETRY_S
                self._uncommitted.clear()
                await first_of(self._uncommitted.wait(), stop.wait())
                continue
            await first_of(stop.wait(), at_most_s=delay)
            delay = min(delay * 2, self.config.state.commit_retry_max_s)
            async with self.lock:
                if self.state.commit_error is not None and not stop.is_set():
                    had = bool(self.state.pending)
                    self._commit([])
                    if had and self.notifier is not None:
                        self.notifier.wake()

    async def _announce_ready(self, stop: asyncio.Event) -> None:
        await first_of(self.reader.following.wait(), stop.wait())
        if stop.is_set():
            return
        log.info(
            "following_journal",
            cursor=self.reader.cursor,
            reader=resolve_source(self.reader.settings.source),
        )
        if self.reporter is not None:
            self.reporter.ready()
        self._report_status()

    async def _watch_reload(self, stop: asyncio.Event, reload: asyncio.Event) -> None:
        while not stop.is_set():
            await first_of(reload.wait(), stop.wait())
            if reload.is_set():
                reload.clear()
                self.reload_table()

    def reload_table(self) -> None:
        """Load the signature table again; keep the old one when the new one is broken."""
        if self._load_table is None:
            return
        try:
            table = self._load_table()
        except Exception as exc:
            self.metrics.signature_table([s.id for s in self.pipeline.table.signatures], False)
            log.error("signature_table_reload_failed", error=str(exc))
            return
        self.pipeline.reload(table)
        self.metrics.signature_table([s.id for s in table.signatures], True)
        log.info("signature_table_reloaded", signatures=len(table.signatures))

    def _report_status(self) -> None:
        if self.reporter is None:
            return
        units = ",".join(u.name for u in self.config.units) or "all units"
        with contextlib.suppress(Exception):
            self.reporter.status(
                f"following {units}; {self.state.outcomes} invocations classified, "
                f"{self.state.halts} halts; last: {self.state.last_verdict}"
            )


def _after(cursor: str, saved: str) -> bool:
    """True when `cursor` lies after `saved` in time (used when `saved` was vacuumed)."""
    a, b = cursor_realtime_us(cursor), cursor_realtime_us(saved)
    return a is not None and b is not None and a > b
