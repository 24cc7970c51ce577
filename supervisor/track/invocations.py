"""The invocations of one unit on one host: the state machine from the first entry to an `Ending`.

An invocation (`Run` until it is returned) begins with its first entry, a service line or PID 1's
"Starting"; PID 1's lifecycle messages, recognised by MESSAGE_ID and never by their text, say how
it went: its main process started, a stop was requested, it exited (with what code), it was
OOM-killed. It ends on "Failed with result" or "Deactivated successfully", a stop job's end or a
skipped start; failing those, on the start of a newer invocation (its end was never logged) or a
new boot of its host. An ended invocation settles (supervisor.track.settle) before it is
returned; one still open can be closed on demand (a hung engine).

`UnitRuns` is total: no content and no order of entries raises, every invocation is returned
exactly once, and an entry of an invocation already returned is dropped (a line counted in
`late_lines`).
"""

from __future__ import annotations

import itertools
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import TrackerConfig
from ..environment.serving import is_serving_line, start_phase
from ..journal.cursor import monotonic_seconds_between
from ..model import Ending, Invocation, JournalEntry, LifecycleEvent, field_int
from .retention import KeptLines
from .settle import Deadline, Drained, Now, Window

_E = LifecycleEvent
_KNOWN_EVENTS = frozenset(
    {
        _E.STARTING,
        _E.JOB_STARTED,
        _E.STOPPING,
        _E.JOB_STOPPED,
        _E.PROCESS_EXITED,
        _E.OOM_KILLED,
        _E.UNIT_FAILED,
        _E.DEACTIVATED,
        _E.CONDITION_SKIPPED,
    }
)
_MAIN_COMMANDS = frozenset({"", "ExecStart"})  # COMMAND= of the main process (absent: older)
# PID 1's line (no MESSAGE_ID) for `systemctl kill`: "U: Sent signal SIGKILL to main process
# 85 (sleep) on client request." Only signals that end a process by default count, and only
# for an end soon after: a SIGHUP or SIGUSR1 sent for a reload is no stop.
_KILL_REQUEST = re.compile(
    r"Sent signal SIG(?:KILL|TERM|INT|QUIT|ABRT) to main process \d+ .*on client request"
)
_KILL_TO_END_US = 60_000_000

_PIDS_REMEMBERED = 64  # per invocation: which processes' id-less lines belong to it
_CLOSED_REMEMBERED = 256  # per unit and host: ids already returned, whose late entries drop


@dataclass(frozen=True, slots=True)
class Context:
    """What every unit's state machine shares: the config, the settle waits, the reader's
    clock and the order lines were read in."""

    caps: TrackerConfig
    window: Window
    clock: Callable[[], float]
    seq: Callable[[], int] = field(default_factory=lambda: itertools.count().__next__)


@dataclass(frozen=True, slots=True, kw_only=True)
class SuppressionNotice:
    """journald dropped lines of a unit, reported after the invocations they belonged to ended.

    journald writes "Suppressed N messages from U" only when the unit logs again after its rate
    limit interval, often from a later invocation; the decisions already made stand (they were
    about the present), and the notice amends what history says about them.
    """

    unit: str | None
    host: str | None
    dropped: int
    invocation_ids: tuple[str, ...]  # the decided invocations that ran within the interval
    realtime_us: int


@dataclass(slots=True)
class Run:
    """One invocation until it is returned: what the journal said of it, and its kept lines."""

    unit: str | None
    invocation_id: str | None
    host: str | None
    hostname: str | None
    boot_id: str | None
    lines: KeptLines
    first_cursor: str | None = None
    started_us: int | None = None
    restarts: int = 0
    total: int = 0
    suppressed: int = 0
    exit_code: str | None = None
    exit_status: int | None = None
    result: str | None = None
    oom_killed: bool = False
    ending: Ending | None = None  # None while it runs
    closed: bool = False  # returned: nothing more joins it
    stop_requested: bool = False
    kill_requested_us: int | None = None  # `systemctl kill` (a person, a tool) signalled it
    main_started: bool = False
    start_seen: bool = False  # PID 1's "Starting"/"Started" of it was read
    control_killed: bool = False  # a control process (the gate) was killed before the main ran
    served_us: int | None = None
    phase: str | None = None  # the last phase of its start its lines named, before it served
    end_message: str | None = None
    restart_of: str | None = None
    restart_scheduled: int | None = None
    ended_us: int | None = None
    settle: Deadline | None = None  # once ended: when it is decided
    last_cursor: str | None = None
    end_cursor: str | None = None  # PID 1's entry that ended it
    last_us: int = 0
    pids: set[int] = field(default_factory=set)
    # Its lines as journald's rate limit counts them: an interval begins at the first line
    # after the last one ended (RateLimitIntervalSec=), and lines past the burst are dropped.
    limit_interval_us: int = 30_000_000
    limit_burst: int = 0
    limit_begun_us: int = 0
    limit_lines: int = 0
    # What the supervisor's gate begins its lines in this unit's journal with (each line
    # passes here: worked out once per run, not per line).
    gate_prefixes: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.gate_prefixes = gate_prefixes(self.unit)

    def killed_on_request(self, end_us: int) -> bool:
        """Did a person's or a tool's kill request end it (the end came soon after)?"""
        requested = self.kill_requested_us
        return requested is not None and 0 <= end_us - requested <= _KILL_TO_END_US

    def add_line(self, seq: int, entry: JournalEntry) -> None:
        """One of its service's lines (every line passes here)."""
        self.total += 1
        self.last_cursor = entry.cursor
        if entry.realtime_us > self.last_us:
            self.last_us = entry.realtime_us
        if entry.realtime_us - self.limit_begun_us > self.limit_interval_us:
            self.limit_begun_us, self.limit_lines = entry.realtime_us, 0
        self.limit_lines += 1
        if entry.message.startswith(self.gate_prefixes):
            return  # the supervisor's own words, never the server's output nor its cause
        pid = entry.pid
        if pid is not None and pid not in self.pids and len(self.pids) < _PIDS_REMEMBERED:
            self.pids.add(pid)
        if self.served_us is None:
            if is_serving_line(entry.message):
                self.served_us = entry.realtime_us
            elif (phase := start_phase(entry.message)) is not None:
                self.phase = phase
        self.lines.add((seq, entry.message, pid, entry.priority, entry.realtime_us))

    def touch(self, entry: JournalEntry) -> None:
        """Account for one of PID 1's messages about it (not a line)."""
        self.last_cursor = entry.cursor
        if entry.realtime_us > self.last_us:
            self.last_us = entry.realtime_us

    def build(self, ending: Ending) -> Invocation:
        lines = self.lines.lines()
        ended = self.ended_us if self.ended_us is not None else self.last_us or None
        end_cursor = self.end_cursor or self.last_cursor
        return Invocation(
            ran_monotonic_s=monotonic_seconds_between(self.first_cursor, end_cursor),
            unit=self.unit,
            invocation_id=self.invocation_id,
            lines=lines,
            total_lines=self.total,
            dropped_lines=self.total - len(lines),
            suppressed_lines=self.suppressed,
            lines_in_limit_interval=self.limit_lines,
            limit_burst=self.limit_burst,
            exit_code=self.exit_code,
            exit_status=self.exit_status,
            result="exec-condition" if ending is Ending.SKIPPED else self.result,
            restarts=self.restarts,
            oom_killed=self.oom_killed,
            hung=ending is Ending.HUNG,
            started_us=self.started_us,
            ended_us=ended,
            first_cursor=self.first_cursor,
            last_cursor=self.last_cursor,
            ending=ending,
            host=self.host,
            hostname=self.hostname,
            boot_id=self.boot_id,
            stop_requested=self.stop_requested,
            main_started=self.main_started,
            start_seen=self.start_seen,
            served_us=self.served_us,
            end_message=self.end_message,
            restart_of=self.restart_of,
            restart_scheduled=self.restart_scheduled,
        )


class UnitRuns:
    """One unit on one host: its invocations in flight, and the ids already returned."""

    def __init__(self, unit: str | None, context: Context) -> None:
        self.unit = unit
        self._context = context
        self.running: dict[str | None, Run] = {}  # not ended, by id
        self.settling: dict[str | None, Run] = {}  # ended, waiting for late lines
        self.closed: OrderedDict[str, tuple[int | None, int | None]] = OrderedDict()
        self.restarts = 0  # the last restart counter systemd logged
        self.pending_restart_of: str | None = None  # an ended invocation, its restart scheduled
        self.boot_id: str | None = None
        self.late_lines = 0  # lines of invocations already returned (dropped)
        self.fed: Run | None = None  # the open run the last line joined, named as the line

    def run_of(self, invocation_id: str | None) -> Run | None:
        return self.running.get(invocation_id) or self.settling.get(invocation_id)

    def newest_running(self) -> Run | None:
        return next(reversed(self.running.values()), None)

    def newest_id(self) -> str | None:
        """The id of its newest invocation read: running, else ending, else returned last."""
        for runs in (self.running, self.settling):
            for run in reversed(runs.values()):
                if run.invocation_id is not None:
                    return run.invocation_id
        return next(reversed(self.closed), None)

    # -- service lines --------------------------------------------------------------------------

    def line(self, entry: JournalEntry) -> list[Invocation]:
        """A line of the unit's service: the run it joins; the runs a newer one ended."""
        invocation_id = entry.invocation_id
        ended: list[Invocation] = []
        self.fed = None
        if invocation_id is None:
            run = self._owner_of_anonymous(entry.pid)
        elif (owner := self._ended_owner(entry)) is not None:
            run = owner
        elif invocation_id in self.closed:
            self.late_lines += 1
            return []
        else:
            run = self.run_of(invocation_id)
            if run is None:
                ended, run = self._first_line(entry, invocation_id)
        if run is None:
            run = self._begin(entry)
        run.add_line(self._context.seq(), entry)
        if run.ending is None and run.invocation_id == invocation_id:
            self.fed = run
        return ended

    def _first_line(self, entry: JournalEntry, invocation_id: str) -> tuple[list[Invocation], Run]:
        """The first line of an id: the unnamed run is this one, or a new run begins."""
        unnamed = self.running.get(None)
        if unnamed is not None:
            # journald reads the id from the cgroup and can miss it on a line printed as a
            # process exits: the unnamed invocation is this one, now named.
            return [], self._name(unnamed, invocation_id)
        ended = self._supersede(invocation_id)
        self._cut_settling(invocation_id, entry.realtime_us)
        return ended, self._begin(entry)

    def _owner_of_anonymous(self, pid: int | None) -> Run | None:
        """A line without an invocation id: its process's invocation, else the running one."""
        if pid is not None:
            for run in (*self.running.values(), *self.settling.values()):
                if pid in run.pids:
                    return run
        return self.newest_running() or next(reversed(self.settling.values()), None)

    def _ended_owner(self, entry: JournalEntry) -> Run | None:
        """The ended invocation, still awaiting late lines, that printed this line, if any.

        journald stamps a stream's line with the invocation id it reads from the unit's cgroup
        when it writes the line, so a dead process's lines that it writes after the unit
        restarted carry the new run's id (seen on systemd 252, seconds after a flood). So a
        line stamped with a run whose main process has not started, from a process of the
        ended run, is the ended run's: a process belongs to one run, and PIDs are not reused
        within seconds.
        """
        if entry.invocation_id is None:
            return None
        stated = self.run_of(entry.invocation_id)
        if stated is None or stated.ending is not None:
            return stated
        if stated.main_started or entry.pid is None or entry.pid in stated.pids:
            return None
        return next((r for r in self.settling.values() if entry.pid in r.pids), None)

    # -- PID 1's messages -----------------------------------------------------------------------

    def lifecycle(self, entry: JournalEntry) -> list[Invocation]:
        """One of PID 1's messages about the unit: how a run went; the runs it ended."""
        event = entry.message_id
        invocation_id = entry.invocation_id
        if event == _E.RESTART_SCHEDULED:
            self._restart_scheduled(entry)
            return []
        if event == _E.UNIT_FAILED and entry.fields.get("UNIT_RESULT") == "start-limit-hit":
            return self._start_limit(entry)
        if self._cancels_restart(event, entry):
            self.pending_restart_of = None  # a stop job cancelled the pending restart
        if invocation_id is not None and invocation_id in self.closed:
            return []
        if event is None:
            self._kill_request(entry)
            return []
        if event not in _KNOWN_EVENTS:
            return []
        ended, run = self._run_for(event, entry)
        if run is None:
            return ended
        run.touch(entry)
        if event in (_E.STARTING, _E.JOB_STARTED):
            run.start_seen = True
        if run.ending is not None or event == _E.STARTING:
            return ended  # already ended (only waiting for late lines), or just begun
        return ended + self._went(run, event, entry)

    def _cancels_restart(self, event: str | None, entry: JournalEntry) -> bool:
        return (
            event == _E.JOB_STOPPED
            and entry.fields.get("JOB_TYPE") == "stop"
            and self.pending_restart_of == entry.invocation_id
        )

    def _run_for(self, event: str, entry: JournalEntry) -> tuple[list[Invocation], Run | None]:
        """The run a known lifecycle message is about (begun for it if need be), and the runs
        that ended as it began; no run for a stop of one this journal never showed."""
        invocation_id = entry.invocation_id
        run = self.run_of(invocation_id)
        ended: list[Invocation] = []
        if event == _E.STARTING or (event == _E.JOB_STARTED and run is None):
            ended += self._next_start(invocation_id, entry)
            run = self.run_of(invocation_id)
        if run is not None:
            return ended, run
        if event in (_E.JOB_STOPPED, _E.STOPPING):
            return ended, None
        if invocation_id is not None and None in self.running:
            return ended, self._name(self.running[None], invocation_id)
        ended += self._supersede(invocation_id)
        return ended, self._begin(entry)

    def _went(self, run: Run, event: str, entry: JournalEntry) -> list[Invocation]:
        """What a lifecycle message says of a run that has not ended; the runs it ended."""
        if event == _E.JOB_STARTED:
            # The same MESSAGE_ID says "Condition check resulted in U being skipped." (skipped).
            run.main_started = entry.fields.get("JOB_RESULT") in (None, "done")
        elif event == _E.STOPPING:
            run.stop_requested = True
        elif event == _E.PROCESS_EXITED:
            self._exited(run, entry)
        elif event == _E.OOM_KILLED:
            run.oom_killed = True
            run.end_message = _without_unit(entry.message, run.unit)
        elif event == _E.JOB_STOPPED:
            # "Stopped" without "Failed"/"Deactivated" first: the stop job's end is its end.
            return self._end(run, entry, None)
        else:  # failed, deactivated, skipped
            return self._end(run, entry, entry.fields.get("UNIT_RESULT"))
        return []

    def _restart_scheduled(self, entry: JournalEntry) -> None:
        self.restarts = field_int(entry.fields.get("N_RESTARTS")) or 0
        self.pending_restart_of = entry.invocation_id
        run = self.run_of(entry.invocation_id)
        if run is not None:
            run.restart_scheduled = self.restarts
            run.touch(entry)

    def _kill_request(self, entry: JournalEntry) -> None:
        if _KILL_REQUEST.search(entry.message):
            killed = self.run_of(entry.invocation_id)
            if killed is not None and killed.ending is None:
                killed.kill_requested_us = entry.realtime_us

    def _exited(self, run: Run, entry: JournalEntry) -> None:
        fields = entry.fields
        command = fields.get("COMMAND", "")
        code, status = fields.get("EXIT_CODE"), field_int(fields.get("EXIT_STATUS"))
        if command in _MAIN_COMMANDS:
            run.main_started = True
            run.exit_code, run.exit_status = code, status
            if not run.oom_killed:
                run.end_message = _without_unit(entry.message, run.unit)
        elif code == "killed" and not run.main_started:
            run.control_killed = True  # e.g. the gate, killed by a stop job

    def _end(self, run: Run, entry: JournalEntry, result: str | None) -> list[Invocation]:
        """PID 1 said the run ended: how, and it settles (or is returned now)."""
        event = entry.message_id
        run.result = result or ("success" if event == _E.DEACTIVATED else run.result)
        run.ended_us = entry.realtime_us
        run.end_cursor = entry.cursor
        run.ending = _ending_of(run, entry)
        self.running.pop(run.invocation_id, None)
        window = self._context.window
        if not window.settles or run.ending is Ending.SKIPPED:
            # Those that ended before it are returned first: decisions stay in journal order.
            earlier = [self.close(r) for r in list(self.settling.values())]
            return [*earlier, self.close(run)]
        run.settle = Deadline.after_end(entry.realtime_us, self._context.clock(), window)
        self.settling[run.invocation_id] = run
        return []

    def _next_start(self, invocation_id: str | None, entry: JournalEntry) -> list[Invocation]:
        """A start job began ("Starting U..."): a new invocation, and the last one is done."""
        ended = self._supersede(invocation_id)
        self._cut_settling(invocation_id, entry.realtime_us)
        if self.run_of(invocation_id) is None:
            if invocation_id is not None and None in self.running:
                run = self._name(self.running[None], invocation_id)
            else:
                run = self._begin(entry)
            # systemd counts automatic restarts only; any other start resets NRestarts to 0.
            run.restart_of = self.pending_restart_of
            run.restarts = self.restarts if run.restart_of is not None else 0
            self.restarts = run.restarts
        self.pending_restart_of = None
        return ended

    def _start_limit(self, entry: JournalEntry) -> list[Invocation]:
        """systemd gave up restarting the unit: reported once, as an invocation of its own.

        PID 1 logs it about the last invocation (no new one was started), which has usually been
        returned already; one still in flight is returned first, as it ended.
        """
        ended: list[Invocation] = []
        run = self.run_of(entry.invocation_id)
        if run is not None:
            ended.append(self.close(run))
        self.pending_restart_of = None
        ended.append(
            Invocation(
                unit=self.unit,
                invocation_id=None,
                lines=(),
                result="start-limit-hit",
                restarts=self.restarts,
                ending=Ending.START_LIMIT,
                host=entry.host,
                hostname=entry.hostname,
                boot_id=entry.boot_id,
                started_us=entry.realtime_us,
                ended_us=entry.realtime_us,
                first_cursor=entry.cursor,
                last_cursor=entry.cursor,
            )
        )
        return ended

    # -- other ends -----------------------------------------------------------------------------

    def _supersede(self, invocation_id: str | None) -> list[Invocation]:
        """A newer invocation appears: running ones with another id ended, their end unseen."""
        stale = [r for r in self.running.values() if r.invocation_id not in (None, invocation_id)]
        ended = [self.close(r, Ending.UNSEEN) for r in stale]
        if len(self.running) >= self._context.caps.max_open_invocations:
            oldest = next(iter(self.running.values()))
            ended.append(self.close(oldest, Ending.UNSEEN))
        return ended

    def new_boot(self, boot_id: str) -> list[Invocation]:
        """The host booted again: what ran in the old boot ended with it."""
        old = self.boot_id
        self.boot_id = boot_id
        if old is None:
            return []
        ended = [
            self.close(r, Ending.BOOT)
            for r in list(self.running.values())
            if r.boot_id not in (None, boot_id)
        ]
        ended += [
            self.close(r) for r in list(self.settling.values()) if r.boot_id not in (None, boot_id)
        ]
        self.pending_restart_of = None
        self.restarts = 0
        return ended

    def suppressed(self, entry: JournalEntry) -> SuppressionNotice | None:
        """journald's "Suppressed N messages": counted where they were lost, or a notice about
        invocations already returned."""
        dropped = field_int(entry.fields.get("N_DROPPED")) or 0
        if dropped <= 0:
            return None
        after = entry.fields.get("OBJECT_SYSTEMD_INVOCATION_ID")
        # The notice comes with the first line after the interval, often a later invocation's
        # ("after"): the lines were lost from the invocations that logged before it.
        candidates = [
            r for r in (*self.settling.values(), *self.running.values()) if r.invocation_id != after
        ]
        if candidates:
            candidates[-1].suppressed += dropped
            return None
        since = entry.realtime_us - int(self._context.caps.ratelimit_interval_s * 1_000_000)
        ids = tuple(
            inv_id
            for inv_id, (started, ended) in self.closed.items()
            if (ended or started or 0) >= since and inv_id != after
        )
        running = self.run_of(after)
        if not ids and running is not None:
            running.suppressed += dropped  # its own lines, then
            return None
        return SuppressionNotice(
            unit=self.unit,
            host=entry.host,
            dropped=dropped,
            invocation_ids=ids,
            realtime_us=entry.realtime_us,
        )

    # -- settling -------------------------------------------------------------------------------

    def still_writing(self, entry: JournalEntry) -> None:
        """A line of an invocation that already ended: journald is still writing what its
        processes printed (a flood just before a crash takes it seconds, and the cause comes
        last), so its decision waits for more, up to `drain_max_s` after its end."""
        run = (
            self._ended_owner(entry)
            if entry.invocation_id is not None
            else self._owner_of_anonymous(entry.pid)
        )
        if run is None or run.ending is None or run.settle is None:
            return
        run.settle.still_writing(entry.realtime_us, self._context.clock(), self._context.window)

    def _cut_settling(self, invocation_id: str | None, now_us: int) -> None:
        """A newer invocation began: the ended ones' processes are gone, wait only a little."""
        read_now = self._context.clock()
        for run in self.settling.values():
            if run.invocation_id != invocation_id and run.settle is not None:
                run.settle.cut(now_us, read_now, self._context.window)

    def due(self, now: Now, drained: Drained | None = None) -> list[Invocation]:
        """The ended runs whose wait for late lines is over, returned."""
        if not self.settling:
            return []
        due = [r for r in self.settling.values() if r.settle is None or r.settle.due(now, drained)]
        return [self.close(r) for r in due]

    # -- beginning and returning ----------------------------------------------------------------

    def _begin(self, entry: JournalEntry) -> Run:
        run = Run(
            unit=self.unit,
            invocation_id=entry.invocation_id,
            host=entry.host,
            hostname=entry.hostname,
            boot_id=entry.boot_id,
            lines=KeptLines(self._context.caps),
            first_cursor=entry.cursor,
            started_us=entry.realtime_us,
            restarts=self.restarts,
            limit_interval_us=int(self._context.caps.ratelimit_interval_s * 1_000_000),
            limit_burst=self._context.caps.ratelimit_burst,
        )
        run.touch(entry)
        self.running[entry.invocation_id] = run
        return run

    def _name(self, run: Run, invocation_id: str) -> Run:
        del self.running[None]
        run.invocation_id = invocation_id
        self.running[invocation_id] = run
        return run

    def close(self, run: Run, ending: Ending | None = None) -> Invocation:
        """Return `run` as an ended invocation; it is forgotten except for its id."""
        if self.running.get(run.invocation_id) is run:
            del self.running[run.invocation_id]
        if self.settling.get(run.invocation_id) is run:
            del self.settling[run.invocation_id]
        run.closed = True
        if run.invocation_id is not None:
            self.closed[run.invocation_id] = (run.started_us, run.ended_us)
            while len(self.closed) > _CLOSED_REMEMBERED:
                self.closed.popitem(last=False)
        final = ending or run.ending or Ending.UNSEEN
        if run.ended_us is None and final is not Ending.OPEN:
            run.ended_us = run.last_us or None
        return run.build(final)


def _ending_of(run: Run, entry: JournalEntry) -> Ending:
    """How a run that PID 1 says ended, ended."""
    if entry.message_id == _E.CONDITION_SKIPPED:
        return Ending.SKIPPED
    if run.control_killed and not run.main_started:
        return Ending.GATE_STOPPED
    if run.stop_requested or run.killed_on_request(entry.realtime_us):
        return Ending.STOPPED
    return Ending.EXITED


def _without_unit(message: str, unit: str | None) -> str:
    """PID 1's text without its "unit: " prefix (the unit is named elsewhere)."""
    prefix = f"{unit}: "
    return message[len(prefix) :] if unit and message.startswith(prefix) else message


# How the supervisor's gate writes into the unit's journal (supervisor.commands.gate): each line
# begins with the unit's name, or is one of its two fixed hints. Such a line may quote outside
# text (a port holder's command line); kept as a line of the next run, that text became its root
# cause. No engine begins a line with its unit's name and a colon.
_GATES_HINTS = ("release it with: vllm-supervisor release ", "start it now with: vllm-supervisor ")


def gate_prefixes(unit: str | None) -> tuple[str, ...]:
    """How every line the supervisor's gate writes into `unit`'s journal begins."""
    return (f"{unit}: ", *_GATES_HINTS) if unit is not None else _GATES_HINTS
