"""The live daemon: the pipeline plus actions, checkpoints and a bounded shutdown.

`Daemon.run(stop, reload)` knows nothing about OS signals (the CLI turns SIGTERM into `stop` and
SIGHUP into `reload`), so tests embed it directly.

Per batch of journal entries: track and classify (pure), let the actor carry out each decision
(supervisor.actions: confirmed with systemd, the present only), then commit the cursor, history,
policy memory and queued notifications in one transaction. A crash anywhere replays the batch
from the previous cursor; the store, the outbox and the quarantine are idempotent per
invocation. Journal content never stops the daemon: an unexpected error while handling one
entry or one invocation is logged once with its cursor, counted, and skipped.

The served units' gates (supervisor.actions.gatekeeper) wait on `gate_answer`, which returns
once the journal has been read up to the gate's own start and everything before it is decided.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from .actions.actor import Actor
from .actions.presence import Here
from .actions.unitnames import RealNames
from .classify.signatures import SignatureTable
from .classify.table import load_table
from .config import Config, restart_only_changes
from .engines.profiles import Engines, load_engines
from .engines.profiles import install as install_engines
from .errors import StateError, SupervisorError
from .journal.reader import (
    JournalctlReader,
    ReaderSettings,
    cursor_realtime_us,
    resolve_source,
)
from .journal.streams import count_streams
from .journal.writer import local_boot_id, local_machine_id
from .model import Ending, Invocation, JournalEntry, Outcome, Taken
from .pipeline import Pipeline
from .seams import BatchHook, DriftLookup, Notifying, OutcomeSource, StatusReporter, Task
from .store import Checkpoint, Store
from .telemetry.looplag import LoopLag
from .telemetry.metrics import Metrics
from .track.tracker import SuppressionNotice
from .util.aio import first_of
from .util.memory import give_back_startup_memory
from .util.retry import Backoff

log = structlog.get_logger(__name__)

COMMIT_RETRY_S = 0.25  # first wait before retrying a failed state commit (doubles, capped)
GATE_KICK_S = 0.01
# While journald still reads a dead process's stream, the settle loop looks again this often.
DRAIN_POLL_S = 0.005
# After systemd announced a state change, the reader looks at these offsets: PID 1's own log
# lines about it can reach the journal files a little after the bus signal.
LOOK_AFTER_CHANGE_S = (0.0, 0.005, 0.02, 0.05, 0.1)
# After SIGTERM, the daemon's own tasks get this long to finish; app.close_within gets
# CLOSE_BUDGET_S for the sockets and the bus: together well inside TimeoutStopSec=20s.
SHUTDOWN_GRACE_S = 10.0  # while a gate waits for its start to be read, the reader looks this often

# Handed the new config at each reload: applies what it can of it to its part (a webhook URL
# rewritten in its file or credential) and names what only a restart applies, for
# `not_reloaded`.
Reloader = Callable[[Config], Awaitable[list[str]]]


@dataclass(slots=True)
class DaemonState:
    """What the daemon has seen so far, for STATUS= and /healthz."""

    entries: int = 0
    outcomes: int = 0
    halts: int = 0
    skipped_errors: int = 0  # entries or invocations whose handling raised (logged, skipped)
    last_verdict: str = "none yet"
    state_errors: int = 0
    pending: list[Outcome] = field(default_factory=list)
    commit_error: str | None = None  # why the last commit failed; None once one succeeds
    not_reloaded: list[str] = field(default_factory=list)  # what waits for a restart


class Daemon:
    """Follows the journal and acts on every ended invocation of the configured units."""

    def __init__(
        self,
        config: Config,
        table: SignatureTable,
        *,
        store: Store,
        metrics: Metrics,
        actor: Actor | None = None,
        notifier: Notifying | None = None,
        reporter: StatusReporter | None = None,
        load_config: Callable[[], Config] | None = None,
        hooks: Sequence[BatchHook] = (),
        tasks: Sequence[Task] = (),
        sources: Sequence[OutcomeSource] = (),
        drift: DriftLookup | None = None,
        shutdown_grace_s: float = SHUTDOWN_GRACE_S,
        wakers: Sequence[Callable[[], None]] = (),
        names: RealNames | None = None,
        reloaders: Sequence[Reloader] = (),
    ) -> None:
        self.config = config
        # The units' real names (config already under them): a reload is resolved again.
        self.names = names or RealNames(None)
        self.store = store
        self.metrics = metrics
        self.actor = actor
        self.notifier = notifier
        self.reporter = reporter
        self.state = DaemonState()
        self._load_config = load_config
        self.reloaders = tuple(reloaders)
        self.hooks = tuple(hooks)
        self.tasks = tuple(tasks)
        self.sources = tuple(sources)
        self.shutdown_grace_s = shutdown_grace_s
        # Told when outcomes were recorded or a unit released (the Alertmanager sink).
        self.wakers = tuple(wakers)
        # Held while a batch (or outcomes found outside one, a hung engine) is acted on and
        # committed, so a commit never saves a cursor past outcomes not yet recorded.
        self.lock = asyncio.Lock()
        self._ending = asyncio.Event()  # set when an ended invocation awaits its late lines
        self._remain: set[asyncio.Task[None]] = set()  # looks for RemainAfterExit= ends
        self._progress = asyncio.Event()  # replaced (after being set) at each handled batch
        self._uncommitted = asyncio.Event()  # set when a commit failed (disk full)
        self._cursor_behind = asyncio.Event()  # set when a batch left its cursor uncommitted
        self.machine_id = supervised_machine_id(config)
        self.boot_id = local_boot_id()
        self.checkpoint = store.load_checkpoint()
        self.pipeline = Pipeline(
            config,
            table,
            policy_state=store.load_unit_states(),
            observer=metrics.outcome,
            on_skip=lambda: metrics.entry_invalid("pipeline_error"),
            drift=drift,
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
        # Ended invocations of this host are decided once journald has written their processes'
        # last lines and the reader has read them (journal.streams), not after the whole
        # settle window: only the system journal's own journald can be asked.
        self._settle_early = config.journal.directory is None and self.reader.can_sync
        self._committed_at = 0.0  # time.monotonic() of the last successful commit
        self.loop_lag = LoopLag(metrics.loop_lag)
        metrics.register_units(u.name for u in config.units)
        metrics.signature_table([s.id for s in table.signatures], True)
        log.debug("daemon_built", machine_id=self.machine_id, boot_id=self.boot_id)

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
        """Run until `stop` is set; SIGHUP-style reloads when `reload` is set.

        Once `stop` is set the tasks beside the reader get `shutdown_grace_s` to finish (an
        in-flight Slack attempt, a probe of the served interpreter); then they are cancelled
        with one line naming them, so a stop always ends inside the unit's TimeoutStopSec=.
        """
        reload = reload or asyncio.Event()
        log.info("supervisor_starting", units=[u.name for u in self.config.units])
        async with asyncio.TaskGroup() as group:
            beside = [
                group.create_task(self._watch_reload(stop, reload), name="reload"),
                group.create_task(self._announce_ready(stop), name="ready"),
                group.create_task(self._settle(stop), name="settle"),
                group.create_task(self._retry_commits(stop), name="commit-retry"),
                group.create_task(self._checkpoint_quiet(stop), name="checkpoint"),
            ]
            if self.notifier is not None:
                beside.append(group.create_task(self.notifier.run(stop), name="notifier"))
            for task in self.tasks:
                beside.append(group.create_task(task(stop), name=_name_of(task)))
            for source in self.sources:
                beside.append(group.create_task(source.run(stop, self), name=_name_of(source)))
            group.create_task(self._bound_shutdown(stop, beside))
            try:
                await self._follow(stop)
            finally:
                stop.set()
                self.loop_lag.stop()
        log.info("supervisor_stopped", entries=self.state.entries, outcomes=self.state.outcomes)

    async def _bound_shutdown(self, stop: asyncio.Event, tasks: list[asyncio.Task[None]]) -> None:
        """After `stop`: wait `shutdown_grace_s` for `tasks`, then cancel what still runs."""
        await stop.wait()
        running = [t for t in tasks if not t.done()]
        if not running:
            return
        _, late = await asyncio.wait(running, timeout=self.shutdown_grace_s)
        if late:
            names = sorted(t.get_name() for t in late)
            log.warning(
                "shutdown_cancelled",
                tasks=names,
                grace_s=self.shutdown_grace_s,
                action="cancelled; undelivered messages stay in the outbox for the next start",
            )
            for task in late:
                task.cancel(f"shutdown: still running after {self.shutdown_grace_s}s")

    async def _follow(self, stop: asyncio.Event) -> None:
        async for batch in self.reader.batches(stop):
            await self.handle_batch(batch)
        await self._commit([], force=True)

    async def handle_batch(self, batch: list[JournalEntry]) -> list[Outcome]:
        """Track, decide, act and checkpoint one batch of entries."""
        async with self.lock:
            return await self._handle_batch(batch)

    async def _handle_batch(self, batch: list[JournalEntry]) -> list[Outcome]:
        received = time.time()
        self.loop_lag.poke()
        batch = self._skip_replayed(batch)
        for hook in self.hooks:
            batch = hook.entries(batch)
        outcomes = await self._enrich(self.pipeline.feed(batch))
        self.state.entries += len(batch)
        self.metrics.entries_read(len(batch))
        if batch:
            self.metrics.journal_lag(max(0.0, received - batch[-1].realtime_us / 1e6))
        outcomes = [await self._act(outcome) for outcome in outcomes]
        await self._commit(outcomes)
        _say_backlog(outcomes)
        await self._notices(self.pipeline.tracker.take_notices())
        if outcomes:
            self._wake_sinks()
        if self.pipeline.tracker.next_deadline() is not None:
            self._ending.set()
        self._signal_progress()
        return outcomes

    def _signal_progress(self) -> None:
        """Wake everything waiting for the journal to be read further (the gates)."""
        progress, self._progress = self._progress, asyncio.Event()
        progress.set()

    async def _notices(self, notices: list[SuppressionNotice]) -> None:
        """journald said, late, that it dropped lines of invocations already decided."""
        for notice in notices:
            self.metrics.lines_suppressed(notice.unit, notice.dropped)
            note = (
                f"journald dropped {notice.dropped} lines of {notice.unit} within its rate limit "
                "interval: this verdict may miss its cause"
            )
            log.warning(
                "journal_lines_suppressed",
                unit=notice.unit,
                dropped=notice.dropped,
                invocation_ids=list(notice.invocation_ids),
                action="noted in history; decisions already made stand",
            )
            try:
                await asyncio.to_thread(
                    self.store.add_note, notice.unit, notice.invocation_ids, note
                )
            except StateError as exc:
                log.error("history_note_failed", unit=notice.unit, error=str(exc))

    async def _settle(self, stop: asyncio.Event) -> None:
        """Decide ended invocations once their late lines are read, or their window passed.

        A later entry decides them too (see InvocationTracker.feed); this covers the quiet
        journal after a crash, where no later entry comes. A new batch can move a deadline
        earlier (the unit's next start began), so every batch wakes this loop.
        """
        while not stop.is_set():
            deadline = self.pipeline.tracker.next_deadline()
            self._ending.clear()
            if deadline is None:
                await first_of(self._ending.wait(), stop.wait())
                continue
            delay = deadline - time.monotonic()
            if delay > 0:
                if self._settle_early and self.pipeline.tracker.settling_on(self.machine_id):
                    if await self._decide_drained(delay):
                        continue
                    delay = min(delay, DRAIN_POLL_S)
                await first_of(self._ending.wait(), stop.wait(), at_most_s=delay)
                continue
            async with self.lock:
                outcomes = self.pipeline.flush_quiet()
                if outcomes:
                    await self.handle_outcomes(outcomes)
                self._signal_progress()

    async def _decide_drained(self, within_s: float) -> bool:
        """Decide this host's ended invocations if journald has written every line of the dead
        processes (no stdout stream is left half closed) and the reader has read up to now.
        False when that is not known yet: the caller looks again, or the window decides."""
        asked = time.monotonic()
        try:
            streams = count_streams()
        except OSError as exc:
            return self._no_settle_probe(f"cannot list journald's stdout streams: {exc}")
        if not streams.listening:
            return self._no_settle_probe(
                "journald's stdout socket is not visible (another network namespace?)"
            )
        if streams.dying or not await self.reader.sync(within_s):
            return False
        async with self.lock:
            outcomes = self.pipeline.flush_drained(self.machine_id, asked)
            if outcomes:
                await self.handle_outcomes(outcomes)
            self._signal_progress()
        return bool(outcomes)

    def _no_settle_probe(self, why: str) -> bool:
        """Fall back to the settle window for good, saying why once; False (nothing decided)."""
        self._settle_early = False
        log.warning(
            "settle_probe_unavailable",
            error=why,
            action="ended runs wait settle_s for their late lines",
        )
        return False

    async def gate_answer(
        self, unit: str, invocation_id: str | None, wait_s: float
    ) -> dict[str, Any]:
        """Answer a gate once `unit`'s past is decided: the journal read up to the gate's own
        start (`invocation_id`, from PID 1's "Starting"), no ended invocation left undecided.
        `unit` may be any name of a supervised unit (the gate's %n is its real name)."""
        unit = self.names.real_name(unit)
        if all(u.name != unit for u in self.config.units):
            # A drop-in left on a unit the config no longer names: nothing will decide about
            # it, so waiting would only delay its start by `wait_s`.
            return {"ok": True, "decided": True, "supervised": False}
        deadline = time.monotonic() + wait_s
        tracker = self.pipeline.tracker
        while invocation_id is not None and not tracker.has_seen(unit, invocation_id):
            if not await self._progress_until(deadline, kick=True):
                return {"ok": True, "decided": False, "waited": "start not read in time"}
        while tracker.settling(unit):
            if not await self._progress_until(deadline, kick=False):
                return {"ok": True, "decided": False, "waited": "previous run not decided"}
        async with self.lock:  # the batch that decided it has also acted on it
            pass
        return {"ok": True, "decided": True}

    async def _progress_until(self, deadline: float, *, kick: bool) -> bool:
        """Wait for the next handled batch (with `kick`, asking the reader to look now, again
        every GATE_KICK_S); False once `deadline` (monotonic) has passed."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if kick:
            self.reader.kick()
            remaining = min(remaining, GATE_KICK_S)
        await first_of(self._progress.wait(), at_most_s=remaining)
        return True

    def _wake_sinks(self) -> None:
        if self.notifier is not None:
            self.notifier.wake()
        for wake in self.wakers:
            wake()

    def unit_changed(self, unit: str) -> None:
        """systemd announced a state change of `unit`: read the journal now and a few times
        soon after (timers only), instead of at journald's next notification; and see whether
        its server is gone with the unit left active."""
        loop = asyncio.get_running_loop()
        for delay in LOOK_AFTER_CHANGE_S:
            loop.call_later(delay, self.reader.kick)
        # One look per announcement: a look already under way may have read the state from
        # before this change.
        task = asyncio.create_task(self._end_if_remaining(unit))
        self._remain.add(task)
        task.add_done_callback(self._remain.discard)

    async def _end_if_remaining(self, unit: str) -> None:
        """Under `RemainAfterExit=yes` a server that exits leaves its unit active/exited, and
        PID 1 logs a clean exit only at debug level: nothing in the journal ends the run. So
        systemd's state ends it (the open run is the unit's invocation, no process left),
        once its last lines had `settle_s` to arrive; it is then decided like any run."""
        if self.actor is None:
            return
        state = await self.actor.state(unit)
        if state is None or (state.active_state, state.sub_state) != ("active", "exited"):
            return
        await asyncio.sleep(self.config.tracker.settle_s)  # journald's late lines, not a sync
        await self.reader.sync(self.config.tracker.settle_s)
        async with self.lock:
            if not self.is_open(unit, state.invocation_id or None):
                return
            invocation = self.pipeline.tracker.close(
                unit, self.machine_id, state.invocation_id or None, Ending.EXITED
            )
            if invocation is None:
                return
            invocation = dataclasses.replace(
                invocation,
                end_message="its main process exited; the unit stays active (exited) "
                "under RemainAfterExit=yes",
            )
            log.warning("server_exited_unit_remains", unit=unit, action="decided as ended")
            await self.handle_outcomes([self.pipeline.decide(invocation)])

    def released(self, unit: str) -> None:
        """`vllm-supervisor release UNIT` ran: forget the streak, clear the halted gauge."""
        self.pipeline.policy.forget(unit)
        self.metrics.units_halted(unit, False)
        for wake in self.wakers:
            wake()
        log.info("unit_released", unit=unit)

    def is_open(self, unit: str, invocation_id: str | None) -> bool:
        """True while `unit`'s invocation (`invocation_id`, or any when None) has not ended."""
        current = self.pipeline.tracker.open_invocation(unit)
        if current is None:
            return False
        return invocation_id is None or current.invocation_id == invocation_id

    async def end_hung(
        self, unit: str, host: str | None, invocation_id: str | None
    ) -> Outcome | None:
        """End a hung invocation (its engine died, its unit stays up) and handle it like any
        ended invocation: the pipeline decides, the actor acts, the batch is recorded."""
        async with self.lock:
            if not self.is_open(unit, invocation_id):  # it ended while the hang was confirmed
                return None
            invocation = self.pipeline.tracker.close(unit, host, invocation_id, Ending.HUNG)
            if invocation is None:
                return None
            outcome = self.pipeline.decide(invocation)
            self.metrics.engine_hung(unit, outcome.decision.action)
            recorded = await self.handle_outcomes([outcome])
        return recorded[0] if recorded else outcome

    async def handle_outcomes(self, outcomes: list[Outcome]) -> list[Outcome]:
        """Act on and commit outcomes decided outside a batch (a hung engine); hold `lock`.

        Returns them as recorded (what the actor did)."""
        self.loop_lag.poke()
        outcomes = await self._enrich(outcomes)
        outcomes = [await self._act(outcome) for outcome in outcomes]
        await self._commit(outcomes)
        if outcomes:
            self._wake_sinks()
        return outcomes

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
        """Carry out the decision (the actor confirms it with systemd); the outcome as recorded."""
        self.state.outcomes += 1
        if self.actor is not None:
            try:
                outcome = await self.actor.carry_out(outcome, self._here(outcome.invocation))
            except Exception as exc:
                self.state.skipped_errors += 1
                self.metrics.state_error("other")
                log.error(
                    "action_failed",
                    unit=outcome.invocation.unit,
                    invocation_id=outcome.invocation.invocation_id,
                    cursor=outcome.invocation.last_cursor,
                    error=f"{type(exc).__name__}: {exc}",
                )
        verdict, decision = outcome.verdict, outcome.decision
        if outcome.taken is Taken.HALTED:
            self.state.halts += 1
        self.state.last_verdict = (
            f"{outcome.invocation.unit}: {verdict.signature or verdict.severity}"
        )
        log.info(
            "invocation_ended",
            unit=outcome.invocation.unit,
            invocation_id=outcome.invocation.invocation_id,
            host=outcome.invocation.hostname,
            ending=outcome.invocation.ending.value,
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
        if outcome.invocation.ending is Ending.SKIPPED and outcome.taken is not Taken.RECORDED:
            log.info(
                "start_refused",
                unit=outcome.invocation.unit,
                invocation_id=outcome.invocation.invocation_id,
                action="the gate skipped the start: the unit is quarantined",
            )
        self._report_status()
        return outcome

    def _here(self, invocation: Invocation) -> Here:
        """What the actor needs to know of this host and of what was read since `invocation`."""
        tracker = self.pipeline.tracker
        newer = tracker.open_invocation(invocation.unit, invocation.host)
        return Here(
            machine_id=self.machine_id,
            boot_id=self.boot_id,
            now_us=time.time_ns() // 1000,
            act_window_s=self.config.systemd.act_window_s,
            newer_id=newer.invocation_id if newer is not None else None,
            newer_served=newer is not None and newer.served,
        )

    async def _commit(self, outcomes: list[Outcome], *, force: bool = False) -> None:
        self.state.pending += outcomes
        if self._replay_until is not None:
            return  # the saved cursor still stands until the replay passes it
        if not (force or self.state.pending or self.state.commit_error is not None) and (
            time.monotonic() - self._committed_at < self.config.state.checkpoint_interval_s
        ):
            # Nothing was decided: the cursor alone can wait (see _checkpoint_quiet). Entries
            # read again after a kill only rebuild the open invocation; every decision is
            # committed at once, with the cursor that covers it.
            self._cursor_behind.set()
            return
        writers = [
            self.notifier.writer_for(o) for o in self.state.pending if self.notifier is not None
        ]
        checkpoint = Checkpoint(
            cursor=self.reader.cursor, replay_from=self.pipeline.tracker.replay_from()
        )
        try:
            # In a worker thread: SQLite's fsync (synchronous=FULL) on a slow disk must not
            # stall the watchdog, the gates or the hang detector. Callers hold `lock`, so the
            # state this reads does not change meanwhile.
            await asyncio.to_thread(
                self.store.commit_batch,
                checkpoint=checkpoint,
                outcomes=list(self.state.pending),
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
        """Commit a cursor that batches left uncommitted once the journal goes quiet.

        It sleeps until a batch leaves its cursor uncommitted, so an idle daemon has no timer
        of its own (only the watchdog's pings); then at most `checkpoint_interval_s` later the
        cursor is committed."""
        interval = self.config.state.checkpoint_interval_s
        while not stop.is_set():
            await first_of(self._cursor_behind.wait(), stop.wait())
            if stop.is_set():
                return
            left = interval - (time.monotonic() - self._committed_at)
            if left > 0:
                await first_of(stop.wait(), at_most_s=left)
                continue
            async with self.lock:
                self._cursor_behind.clear()
                if self.reader.cursor != self.checkpoint.cursor:
                    await self._commit([], force=True)

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
                self.notifier.hold(outcome)

    async def _retry_commits(self, stop: asyncio.Event) -> None:
        """Retry a failed commit with capped backoff, also while the journal is quiet."""
        retry = Backoff(COMMIT_RETRY_S, max(COMMIT_RETRY_S, self.config.state.commit_retry_max_s))
        failures = 0  # retries in this outage
        while not stop.is_set():
            if self.state.commit_error is None:
                failures = 0
                self._uncommitted.clear()
                await first_of(self._uncommitted.wait(), stop.wait())
                continue
            failures += 1
            await first_of(stop.wait(), at_most_s=retry.delay(failures))
            async with self.lock:
                if self.state.commit_error is not None and not stop.is_set():
                    had = bool(self.state.pending)
                    await self._commit([])
                    if had:
                        self._wake_sinks()

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
        give_back_startup_memory()

    async def _watch_reload(self, stop: asyncio.Event, reload: asyncio.Event) -> None:
        while not stop.is_set():
            await first_of(reload.wait(), stop.wait())
            if reload.is_set():
                reload.clear()
                loaded = await asyncio.to_thread(self._load_new)  # file reads, off the loop
                if loaded is not None:
                    config = await self.names.resolve(loaded[0])  # asks systemd: not locked
                    pending = await self._reload_parts(config)
                    async with self.lock:
                        install_engines(loaded[2])
                        self._apply(config, loaded[1], pending)

    async def _reload_parts(self, config: Config) -> list[str]:
        """Hand `config` to the reloaders; what they say only a restart applies (a reloader that
        fails is named itself: a reload never ends the daemon)."""
        pending: list[str] = []
        for reloader in self.reloaders:
            try:
                pending += await reloader(config)
            except Exception as exc:
                pending.append(f"{_name_of(reloader)} (failed: {type(exc).__name__}: {exc})")
        return pending

    def _load_new(self) -> tuple[Config, SignatureTable, Engines] | None:
        """The config, table and engine files on disk now; None (logged) when one does not
        load: then the running ones all stay in force."""
        if self._load_config is None:
            return None
        try:
            config = self._load_config()
            return config, load_table(config), load_engines()
        except Exception as exc:  # a reload may refuse a config, never end the daemon
            error = str(exc) if isinstance(exc, SupervisorError) else repr(exc)
            self.metrics.signature_table([s.id for s in self.pipeline.table.signatures], False)
            log.error("config_reload_failed", error=error, action="kept the running config")
            return None

    def _apply(self, config: Config, table: SignatureTable, pending: Sequence[str] = ()) -> None:
        """SIGHUP: apply what can change while running (units, per-unit settings, dry run,
        signatures; the reloaders applied theirs before); name what cannot: the changed
        restart-only keys, and `pending` (what the reloaders could not apply). A config or
        table that failed to load changed nothing."""
        needs_restart = restart_only_changes(self.config, config)
        needs_restart += [p for p in pending if p not in needs_restart]
        self.state.not_reloaded = needs_restart
        added = sorted({u.name for u in config.units} - {u.name for u in self.config.units})
        removed = sorted({u.name for u in self.config.units} - {u.name for u in config.units})
        config = dataclasses.replace(
            self.config, units=config.units, dry_run=config.dry_run, signatures=config.signatures
        )
        self.config = config
        self.pipeline.reload(table, config)
        for hook in self.hooks:
            hook.reconfigure(config)
        self.metrics.register_units(u.name for u in config.units)
        self.metrics.signature_table([s.id for s in table.signatures], True)
        if added or removed:
            self.reader.follow_units(tuple(u.name for u in config.units))
        log.info(
            "config_reloaded",
            units=[u.name for u in config.units],
            added=added,
            removed=removed,
            signatures=len(table.signatures),
            not_reloaded=needs_restart,
            action="restart the daemon to apply the keys in not_reloaded" if needs_restart else "",
        )

    def _report_status(self) -> None:
        if self.reporter is None:
            return
        units = ",".join(u.name for u in self.config.units) or "all units"
        with contextlib.suppress(Exception):
            self.reporter.status(
                f"following {units}; {self.state.outcomes} invocations classified, "
                f"{self.state.halts} halts; last: {self.state.last_verdict}"
            )


def _say_backlog(outcomes: list[Outcome]) -> None:
    """One line per unit for the crashes of a batch that were read late (recorded, not acted on)."""
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


def _name_of(part: object) -> str:
    """A task's name in the shutdown log: the part's class, or its function's name."""
    owner = getattr(part, "__self__", part)
    if owner is not part or not callable(part):
        return type(owner).__name__
    return getattr(part, "__qualname__", type(part).__name__)


def supervised_machine_id(config: Config) -> str:
    """The machine whose units the daemon may act on: the configured one, or this host."""
    return config.journal.machine_id or local_machine_id()


def _after(cursor: str, saved: str) -> bool:
    """True when `cursor` lies after `saved` in time (used when `saved` was vacuumed)."""
    a, b = cursor_realtime_us(cursor), cursor_realtime_us(saved)
    return a is not None and b is not None and a > b
