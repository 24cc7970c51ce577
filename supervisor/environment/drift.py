"""Environment drift in the daemon: a snapshot at each start, good starts marked, drift on crashes.

When a supervised unit starts a new invocation (its first journal line or PID 1's "Started"
carries a new invocation id), the daemon probes the unit's interpreter in a thread and keeps the
snapshot in the environment log (supervisor.environment.log). A start becomes *good* once one of its
lines says the server is serving, or once it ran `drift.good_start_s`. When an invocation
crashes, the evidence it is decided on carries what changed since the last good start
(`flashinfer-python 0.6.3 → 0.6.4`): the decision weighs it, history and Slack show it.

The batch hook only notes starts and good marks (no IO, it runs inside the batch); the recorder
task does the probing and the writes, in order, so a good mark never precedes its snapshot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from ..config import Config
from ..errors import StateError, SystemdError
from ..model import Ended, Evidence, JournalEntry, served_by
from ..store import Store
from .execstart import interpreter_from_exec_start
from .log import EnvironmentLog
from .probe import ProbeError
from .reach import unreachable
from .serving import is_serving_line
from .snapshot import EnvSnapshot, snapshot

log = structlog.get_logger(__name__)

SNAPSHOT_TIMEOUT_S = 30.0  # resolving the interpreter and probing it, per start
CRASH_WAIT_S = 10.0  # how long a crash's evidence waits for its own start's snapshot
_RECENT_STARTS = 64  # starts remembered by invocation, across all units
MAX_START_AGE_S = 300.0  # an older start (a journal read from its head) is not snapshotted now

Snapshotter = Callable[[Path, Sequence[str]], EnvSnapshot]
ExecStart = Callable[[str], Awaitable[list[str]]]


@dataclass(slots=True)
class _Start:
    unit: str
    invocation_id: str
    started: float  # epoch seconds of its first entry
    good: bool = False
    recorded: asyncio.Event = field(default_factory=asyncio.Event)  # snapshot kept (or given up)


@dataclass(frozen=True, slots=True)
class _Good:
    unit: str
    invocation_id: str


class DriftRecorder:
    """The daemon's batch hook and task for environment drift."""

    def __init__(
        self,
        config: Config,
        envlog: EnvironmentLog,
        *,
        exec_start: ExecStart | None,
        snapshotter: Snapshotter = snapshot,
        clock: Callable[[], float] = time.time,
        max_start_age_s: float = MAX_START_AGE_S,
        on_snapshot: Callable[[str, str], None] | None = None,
        reach: Callable[[str], str | None] = unreachable,
    ) -> None:
        self.config = config
        self._on_snapshot = on_snapshot or (lambda unit, outcome: None)
        self.envlog = envlog
        self._exec_start = exec_start
        self._snapshotter = snapshotter
        self._clock = clock
        self._max_age_s = max_start_age_s
        self._units = frozenset(u.name for u in config.units)
        self._starts: dict[str, _Start] = {}  # the newest start per unit
        # Starts by invocation: a backlog holds several starts of a unit before their ends.
        self._recent: OrderedDict[tuple[str, str], _Start] = OrderedDict()
        self._queue: asyncio.Queue[_Start | _Good] = asyncio.Queue()
        self._stopped = False  # the recorder task has ended: nothing queued will be recorded
        self._said: set[tuple[str, str]] = set()  # (unit, event) already logged at its level
        self._reach = reach

    def reconfigure(self, config: Config) -> None:
        """A reloaded config: its units."""
        self.config = config
        self._units = frozenset(u.name for u in config.units)

    def entries(self, batch: list[JournalEntry]) -> list[JournalEntry]:
        """Note new starts and good starts; the batch passes unchanged."""
        units, starts = self._units, self._starts
        for entry in batch:
            unit, invocation_id = entry.unit, entry.invocation_id
            if unit not in units or invocation_id is None:
                continue
            start = starts.get(unit)
            if start is not None and start.good and start.invocation_id == invocation_id:
                continue  # most lines: a known start, already judged good
            self._observe(unit, invocation_id, entry, start)
        return batch

    def _observe(
        self, unit: str, invocation_id: str, entry: JournalEntry, start: _Start | None
    ) -> None:
        """A line of a new start, or of a start not yet judged good (`start`: the unit's last)."""
        seen = entry.realtime_us / 1e6
        if start is None or start.invocation_id != invocation_id:
            start = _Start(unit, invocation_id, seen)
            self._starts[unit] = start
            self._recent[(unit, invocation_id)] = start
            while len(self._recent) > _RECENT_STARTS:
                self._recent.popitem(last=False)
            if not self._stopped and self._clock() - seen <= self._max_age_s:
                self._queue.put_nowait(start)
            else:
                start.recorded.set()  # too old: today's environment says nothing about it
        serving = not entry.from_pid1 and is_serving_line(entry.message)
        good_start_s = self.config.drift.good_start_s
        if served_by(serving_seen=serving, ran_s=seen - start.started, good_start_s=good_start_s):
            start.good = True
            self._queue.put_nowait(_Good(unit, invocation_id))

    async def evidence(self, ended: Ended, evidence: Evidence) -> Evidence:
        """The evidence with what changed since the last good start, for a crash: once the
        crashed start's own snapshot is kept (at most CRASH_WAIT_S), so the decision and the
        report read the same changes."""
        inv = ended.invocation
        if inv.unit not in self._units or inv.unit is None or inv.invocation_id is None:
            return evidence
        start = self._recent.get((inv.unit, inv.invocation_id))
        if start is not None:
            self._good_if_long(start, inv.started_us, inv.ended_us)
        if not (inv.failed or ended.reading.crashed):
            return evidence
        if start is not None:
            try:
                await asyncio.wait_for(start.recorded.wait(), CRASH_WAIT_S)
            except TimeoutError:
                log.warning("drift_snapshot_late", unit=inv.unit, invocation_id=inv.invocation_id)
        try:
            return dataclasses.replace(evidence, drift=drift_of(ended, self.envlog))
        except StateError as exc:
            log.error("drift_read_failed", unit=inv.unit, error=str(exc))
            return evidence

    def _good_if_long(self, start: _Start, started_us: int | None, ended_us: int | None) -> None:
        if start.good or started_us is None or ended_us is None:
            return
        ran_s = (ended_us - started_us) / 1e6
        if served_by(serving_seen=False, ran_s=ran_s, good_start_s=self.config.drift.good_start_s):
            start.good = True
            self._queue.put_nowait(_Good(start.unit, start.invocation_id))

    async def run(self, stop: asyncio.Event) -> None:
        """Take snapshots and write good marks, in the order they were noted, until `stop`."""
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                getter = asyncio.ensure_future(self._queue.get())
                await asyncio.wait({getter, stopping}, return_when="FIRST_COMPLETED")
                if not getter.done():
                    getter.cancel()
                    return
                item = getter.result()
                if isinstance(item, _Good):
                    await self._mark_good(item)
                else:
                    await self._record(item)
        finally:
            stopping.cancel()
            self._release_pending()

    def _release_pending(self) -> None:
        """No snapshot is taken after stop: a crash must not wait CRASH_WAIT_S for one then."""
        self._stopped = True
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, _Start):
                item.recorded.set()

    async def _record(self, start: _Start) -> None:
        try:
            async with asyncio.timeout(SNAPSHOT_TIMEOUT_S):
                python, program = await self._python(start.unit)
                if python is None:
                    self._say_once(start.unit, "drift_no_interpreter", program, None)
                    self._on_snapshot(start.unit, "no_interpreter")
                    return
                try:
                    snap = await asyncio.to_thread(
                        self._snapshotter, python, self.config.drift.packages
                    )
                except ProbeError:
                    blocked = self._reach(str(python))
                    if blocked is None:
                        raise
                    # Hidden by the daemon's sandbox: say it once with the fix, not per start.
                    self._say_once(start.unit, "drift_blind", str(python), blocked)
                    self._on_snapshot(start.unit, "failed")
                    return
            await self.envlog.arecord_start(start.unit, start.invocation_id, snap, start.started)
            log.info("environment_recorded", unit=start.unit, invocation_id=start.invocation_id)
            self._on_snapshot(start.unit, "recorded")
        except (ProbeError, SystemdError, StateError, TimeoutError) as exc:
            log.warning("drift_snapshot_failed", unit=start.unit, error=str(exc) or "timeout")
            self._on_snapshot(start.unit, "failed")
        finally:
            start.recorded.set()

    async def _python(self, unit: str) -> tuple[Path | None, str | None]:
        """The unit's interpreter, and the program its ExecStart= runs (for a message)."""
        configured = self.config.unit(unit).python
        if configured is not None:
            return Path(configured), configured
        if self._exec_start is None:
            return None, None  # no systemd to ask, and no `python` in the unit's config
        argv = await self._exec_start(unit)
        program = next(
            (a.lstrip("@-:+!|") for a in argv if a.lstrip("@-:+!|").startswith("/")), None
        )
        return interpreter_from_exec_start(argv), program

    def _say_once(self, unit: str, event: str, path: str | None, why: str | None) -> None:
        """Why no environment is recorded for `unit`: a warning the first time, then debug (a
        crash loop would otherwise repeat it at every start)."""
        if why is None and path is not None:
            why = self._reach(path)  # a console script the supervisor cannot read
        if why is not None:
            event = "drift_blind"
        first = (unit, event) not in self._said
        self._said.add((unit, event))
        say = log.warning if first and event == "drift_blind" else log.info if first else log.debug
        say(
            event,
            unit=unit,
            path=path,
            error=why
            or "its ExecStart= runs no Python (drift needs `python` in the unit's config)",
            action="no environment recorded for this unit; crashes are decided without drift",
        )

    async def _mark_good(self, good: _Good) -> None:
        try:
            await self.envlog.amark_good(good.unit, good.invocation_id)
        except StateError as exc:
            log.error("drift_mark_good_failed", unit=good.unit, error=str(exc))


def drift_of(ended: Ended, envlog: EnvironmentLog) -> tuple[str, ...]:
    """What changed since the unit's last good start before this crash, as `envlog` recorded
    it: the one lookup, for the daemon and for `triage`. Raises StateError."""
    inv = ended.invocation
    if inv.unit is None or inv.invocation_id is None:
        return ()
    if not (inv.failed or ended.reading.crashed):
        return ()
    return tuple(str(c) for c in envlog.changes_since_last_good(inv.unit, inv.invocation_id))


class RecordedDrift:
    """`triage`'s drift: the environments the daemon recorded on this host (its state
    database, read only). A journal from elsewhere, or a database that cannot be read, gives
    none."""

    def __init__(self, state_dir: Path) -> None:
        self._store = Store.existing_in_directory(state_dir)
        self._envlog = None if self._store is None else EnvironmentLog(self._store)

    def evidence(self, ended: Ended, evidence: Evidence) -> Evidence:
        """The evidence with the recorded drift (unchanged when none can be read)."""
        if self._envlog is None:
            return evidence
        try:
            return dataclasses.replace(evidence, drift=drift_of(ended, self._envlog))
        except StateError:
            return evidence

    def close(self) -> None:
        """Close the state database."""
        if self._store is not None:
            self._store.close()
