"""The live daemon: a loop composed of parts handed in (`app.compose_daemon` builds them).

`Daemon.run(stop, reload)` knows nothing about OS signals (the CLI turns SIGTERM into `stop` and
SIGHUP into `reload`), so tests embed it directly, on a real journal or on batches they hand it.

Per batch of journal entries: the replay skips what was handled before a restart, the hooks
note what they need, the pipeline tracks and reads the lines of each invocation that ended, and
every ended invocation takes the one `record` path: noted with the checkpoint that covers it,
committed (the cursor and the invocation pending, supervisor.loop.checkpoint), and handed to its
unit's lane, which gathers its evidence, decides (the one pure decide `triage` runs too), acts
and records what was taken (supervisor.loop.acting), beside the reading: one unit's slow
systemd or drift snapshot holds no other unit and no gate. The settler decides ended
invocations the journal goes quiet after (supervisor.loop.settle), a hung engine or a server
that exits under RemainAfterExit= is ended here and recorded the same way, the gates are
answered by supervisor.loop.gates, and a reload is read by supervisor.loop.reload and applied
here. Journal content never stops the daemon: an unexpected error while handling one entry or
one invocation is logged once with its cursor, counted, and skipped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from .actions.actor import Actor
from .actions.lanes import Lanes
from .actions.presence import Here
from .actions.releases import take_releases
from .classify.signatures import SignatureTable
from .config import Config, restart_only_changes
from .errors import StateError
from .journal.writer import local_boot_id, local_machine_id
from .loop.acting import Acting, Job, LoopState, report_status
from .loop.checkpoint import Checkpointer
from .loop.gates import GateService
from .loop.reload import Reloader
from .loop.replay import Replay
from .loop.serving_again import ServingAgain
from .loop.settle import Settler
from .model import Ended, Invocation, JournalEntry, Outcome
from .pipeline import Pipeline, SuppressionNotice
from .records import Pending
from .seams import BatchHook, JournalSource, Notifying, OutcomeSource, StatusReporter, Task
from .store import Checkpoint, Store
from .telemetry.looplag import LoopLag
from .telemetry.metrics import Metrics
from .util.aio import Nursery, first_of, name_of
from .util.memory import give_back_startup_memory

log = structlog.get_logger(__name__)

# After systemd announced a state change, the reader looks at these offsets: PID 1's own log
# lines about it can reach the journal files a little after the bus signal.
LOOK_AFTER_CHANGE_S = (0.0, 0.005, 0.02, 0.05, 0.1)
# After SIGTERM, the daemon's own tasks get this long to finish; app.close_within gets
# CLOSE_BUDGET_S for the sockets and the bus: together well inside TimeoutStopSec=20s.
SHUTDOWN_GRACE_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Parts:
    """What the loop is composed of: the journal source and the pipeline it feeds, the replay
    after a restart, the checkpointer, the units' lanes, the settler, the gates, the reloader."""

    reader: JournalSource
    pipeline: Pipeline
    replay: Replay
    checkpointer: Checkpointer
    lanes: Lanes[Job]
    settler: Settler
    gates: GateService
    reloader: Reloader


class Daemon:
    """Follows the journal and acts on every ended invocation of the configured units."""

    def __init__(
        self,
        config: Config,
        parts: Parts,
        *,
        store: Store,
        metrics: Metrics,
        actor: Actor | None = None,
        notifier: Notifying | None = None,
        reporter: StatusReporter | None = None,
        hooks: Sequence[BatchHook] = (),
        tasks: Sequence[Task] = (),
        sources: Sequence[OutcomeSource] = (),
        wakers: Sequence[Callable[[], None]] = (),
        shutdown_grace_s: float = SHUTDOWN_GRACE_S,
        serving_again: ServingAgain | None = None,
    ) -> None:
        self.config = config
        self._serving_again = serving_again
        self.reader, self.pipeline = parts.reader, parts.pipeline
        self.checkpointer, self.lanes = parts.checkpointer, parts.lanes
        self._replay, self._settler = parts.replay, parts.settler
        self._gates, self._reloader = parts.gates, parts.reloader
        self.store = store
        self.metrics = metrics
        self.actor = actor
        self.notifier = notifier
        self.reporter = reporter
        self.hooks = tuple(hooks)
        self.tasks = tuple(tasks)
        self.sources = tuple(sources)
        # Told when outcomes were recorded or a unit released (the Alertmanager sink).
        self.wakers = tuple(wakers)
        self.shutdown_grace_s = shutdown_grace_s
        self.state = LoopState()
        self.machine_id = supervised_machine_id(config)
        self.boot_id = local_boot_id()
        self._acting = Acting(
            pipeline=self.pipeline,
            actor=actor,
            hooks=self.hooks,
            checkpointer=self.checkpointer,
            metrics=metrics,
            state=self.state,
            status=self._report_status,
            wake_sinks=self._wake_sinks,
            held=serving_again.held if serving_again is not None else lambda unit: None,
        )
        self._remain = Nursery()  # looks for RemainAfterExit= ends after systemd's signals
        self.loop_lag = LoopLag(metrics.loop_lag)
        log.debug("daemon_built", machine_id=self.machine_id, boot_id=self.boot_id)

    async def run(self, stop: asyncio.Event, reload: asyncio.Event | None = None) -> None:
        """Run until `stop` is set; SIGHUP-style reloads when `reload` is set.

        Once `stop` is set the tasks beside the reader get `shutdown_grace_s` to finish (an
        in-flight Slack attempt, a probe of the served interpreter, a halt under way); then
        they are cancelled with one line naming them, so a stop always ends inside the unit's
        TimeoutStopSec=. An action cut short stays pending in the state database.
        """
        reload = reload or asyncio.Event()
        log.info("supervisor_starting", units=[u.name for u in self.config.units])
        async with asyncio.TaskGroup() as group:
            beside = [group.create_task(work, name=name) for name, work in self._beside(stop)]
            beside += [
                group.create_task(
                    self._reloader.run(stop, reload, self._apply, lambda: self.pipeline.table),
                    name="reload",
                ),
                *(group.create_task(task(stop), name=name_of(task)) for task in self.tasks),
                *(
                    group.create_task(source.run(stop, self), name=name_of(source))
                    for source in self.sources
                ),
            ]
            group.create_task(self._bound_shutdown(stop, beside))
            try:
                self._releases_while_down()
                await self._resume_pending()
                await self._follow(stop)
            finally:
                stop.set()
                self.loop_lag.stop()
        log.info("supervisor_stopped", entries=self.state.entries, outcomes=self.state.outcomes)

    def _beside(self, stop: asyncio.Event) -> list[tuple[str, Any]]:
        """The loop's own tasks beside the reading, by name."""
        own: list[tuple[str, Any]] = [
            ("actions", self.lanes.run(stop, self._acting.carry_out)),
            ("remain", self._remain.run(stop)),
            ("ready", self._announce_ready(stop)),
            ("settle", self._settler.run(stop, self._decided)),
            ("commit-retry", self.checkpointer.run_retry(stop, on_recovered=self._wake_sinks)),
            ("checkpoint", self.checkpointer.run_quiet(stop)),
        ]
        if self.actor is not None:
            own.append(("actor", self.actor.run(stop)))
        if self.notifier is not None:
            own.append(("notifier", self.notifier.run(stop)))
        return own

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
                action="cancelled; undelivered messages stay in the outbox and actions cut "
                "short stay pending, for the next start",
            )
            for task in late:
                task.cancel(f"shutdown: still running after {self.shutdown_grace_s}s")

    async def _resume_pending(self) -> None:
        """Decide and carry out what a previous run left pending (it died between)."""
        try:
            outcomes, unreadable = await asyncio.to_thread(self.store.pending_actions)
        except StateError as exc:
            log.error("pending_actions_unread", error=str(exc))
            return
        for record in unreadable:
            log.error(
                "pending_action_unreadable",
                record=record,
                action="left in the state database; it is not carried out",
            )
        for pending in outcomes:
            log.info(
                "pending_action_resumed",
                unit=pending.invocation.unit,
                invocation_id=pending.invocation.invocation_id,
                action="decide" if isinstance(pending, Ended) else pending.decision.action.value,
            )
            self._hand_over(pending)

    async def _follow(self, stop: asyncio.Event) -> None:
        async for batch in self.reader.batches(stop):
            await self._handle(batch)
        await self.checkpointer.commit(force=True)

    async def handle_batch(self, batch: list[JournalEntry]) -> list[Outcome]:
        """Track and decide one batch, carry out its actions and checkpoint; the outcomes as
        recorded once their actions are taken (the live loop does not wait for those)."""
        return [await recorded for recorded in await self._handle(batch)]

    async def _handle(self, batch: list[JournalEntry]) -> list[asyncio.Future[Outcome]]:
        received = time.time()
        self.loop_lag.poke()
        batch = self._replay.new_entries(batch, cursor_rejected=self.reader.cursor_rejected)
        for hook in self.hooks:
            batch = hook.entries(batch)
        recorded = self.record(self.pipeline.feed(batch))
        if self._serving_again is not None:
            here = self.machine_id or None
            told = self._serving_again.check(lambda unit: self.pipeline.open_invocation(unit, here))
            self.checkpointer.told(told)
        self.state.entries += len(batch)
        self.metrics.entries_read(len(batch))
        if batch:
            self.metrics.journal_lag(max(0.0, received - batch[-1].realtime_us / 1e6))
        notices = self.pipeline.take_notices()
        self._settler.wake()
        await self.checkpointer.commit()
        await self._notices(notices)
        self._gates.progressed()
        return recorded

    def record(self, ended: list[Ended]) -> list[asyncio.Future[Outcome]]:
        """The one path of every ended invocation: noted with the checkpoint that covers it
        (to be committed), then handed to its unit's lane to be decided, acted on and recorded
        as taken.

        Synchronous: nothing runs between the end and the note, so no commit saves a cursor
        past an ended invocation it does not hold, and a gate that finds the run ended finds
        it in the lane."""
        self.checkpointer.ended(ended, self._checkpoint())
        return [self._hand_over(one) for one in ended]

    async def _decided(self, ended: list[Ended]) -> None:
        """Invocations ended outside a batch (settled, hung, remaining): recorded, committed."""
        if self.record(ended):
            await self.checkpointer.commit()
        self._gates.progressed()

    def _checkpoint(self) -> Checkpoint | None:
        """Where reading resumes now; None while the journal is read again up to the saved
        cursor (that cursor still stands)."""
        if self._replay.active:
            return None
        return Checkpoint(cursor=self.reader.cursor, replay_from=self.pipeline.replay_from())

    def _hand_over(self, pending: Pending) -> asyncio.Future[Outcome]:
        recorded = asyncio.get_running_loop().create_future()
        self.lanes.submit(
            pending.invocation.unit or "", Job(pending, self._here(pending.invocation), recorded)
        )
        return recorded

    def _here(self, invocation: Invocation) -> Here:
        """What the actor needs to know of this host and of what was read since `invocation`."""
        newer = self.pipeline.open_invocation(invocation.unit, invocation.host)
        # A newer run already ended counts too: a batch read again after a restart holds the
        # crash and the runs after it, and the crash is then no "last run" of a stopped unit.
        newest = self.pipeline.newest_invocation_id(invocation.unit, invocation.host)
        return Here(
            machine_id=self.machine_id,
            boot_id=self.boot_id,
            now_us=time.time_ns() // 1000,
            act_window_s=self.config.systemd.act_window_s,
            newer_id=newer.invocation_id if newer is not None else newest,
            newer_served=newer is not None and newer.served,
        )

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
                await self.store.aadd_note(notice.unit, notice.invocation_ids, note)
            except StateError as exc:
                log.error("history_note_failed", unit=notice.unit, error=str(exc))

    async def gate_answer(
        self, unit: str, invocation_id: str | None, wait_s: float
    ) -> dict[str, Any]:
        """A gate's answer (supervisor.loop.gates): once `unit`'s past is decided and done."""
        return await self._gates.answer(unit, invocation_id, wait_s)

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
        self._remain.start(lambda: self._end_if_remaining(unit), name=f"remain {unit}")

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
        if not self.is_open(unit, state.invocation_id or None):
            return
        ended = self.pipeline.close_remaining(unit, self.machine_id, state.invocation_id or None)
        if ended is not None:
            log.warning("server_exited_unit_remains", unit=unit, action="decided as ended")
            await self._decided([ended])

    def _releases_while_down(self) -> None:
        """`release` ran while this daemon was stopped: forget those units as if it heard."""
        for unit in take_releases(self.config.state.runtime_dir):
            log.info("release_read_at_start", unit=unit)
            self.released(unit)

    def released(self, unit: str) -> None:
        """`vllm-supervisor release UNIT` ran: forget the streak, clear the halted gauge."""
        self.pipeline.forget(unit)
        # The memory committed next leaves the unit out: a restart does not read it back.
        self.checkpointer.decided([], self.pipeline.memory())
        self.metrics.released(unit)
        if self._serving_again is not None:
            self._serving_again.released(unit)
        for wake in self.wakers:
            wake()
        log.info("unit_released", unit=unit)

    def is_open(self, unit: str, invocation_id: str | None) -> bool:
        """True while `unit`'s invocation (`invocation_id`, or any when None) has not ended."""
        current = self.pipeline.open_invocation(unit)
        if current is None:
            return False
        return invocation_id is None or current.invocation_id == invocation_id

    async def end_hung(
        self, unit: str, host: str | None, invocation_id: str | None
    ) -> Outcome | None:
        """End a hung invocation (its engine died, its unit stays up) and handle it like any
        ended invocation: the pipeline decides, the lane acts, it is recorded; the outcome as
        recorded."""
        if not self.is_open(unit, invocation_id):  # it ended while the hang was confirmed
            return None
        ended = self.pipeline.close_hung(unit, host, invocation_id)
        if ended is None:
            return None
        (recorded,) = self.record([ended])
        await self.checkpointer.commit()
        outcome = await recorded
        self.metrics.engine_hung(unit, outcome.decision.action)
        return outcome

    async def _announce_ready(self, stop: asyncio.Event) -> None:
        await first_of(self.reader.following.wait(), stop.wait())
        if stop.is_set():
            return
        log.info("following_journal", cursor=self.reader.cursor, reader=self.reader.describe())
        if self.reporter is not None:
            self.reporter.ready()
        self._report_status()
        give_back_startup_memory()

    def _apply(self, config: Config, table: SignatureTable, pending: Sequence[str] = ()) -> None:
        """SIGHUP: apply what can change while running (units, per-unit settings, dry run,
        signatures; the reloaded parts applied theirs before); name what cannot: the changed
        restart-only keys, and `pending` (what the parts could not apply). A config or table
        that failed to load changed nothing."""
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
        self.metrics.signature_table(list(table.ids), True)
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
        report_status(self.reporter, [u.name for u in self.config.units], self.state)


def supervised_machine_id(config: Config) -> str:
    """The machine whose units the daemon may act on: the configured one, or this host."""
    return config.journal.machine_id or local_machine_id()
