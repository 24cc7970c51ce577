"""The invocation tracker: groups journal entries into starts of a unit and sees each one end.

An invocation is one start of a unit on one machine, named by systemd's invocation id
(`_SYSTEMD_INVOCATION_ID` on the service's lines, `INVOCATION_ID` on PID 1's messages). Entries
are attributed to their machine (`_MACHINE_ID`): a journal directory may hold several hosts, and
each host's units are tracked apart. An invocation ends on PID 1's lifecycle messages, recognised
by MESSAGE_ID and never by their text: "Failed with result" or "Deactivated successfully" (after
"Main process exited" gave the exit code), a skipped start; or, failing those, the start of a
newer invocation (its end was never logged) or a new boot of its host (it ended with the boot).

The tracker is *total*: no content and no order of entries raises. Every invocation is returned
exactly once, and no entry lands in two invocations: an entry of an invocation already returned
is dropped (a service line counted in `late_lines`), a line without an invocation id goes to
the invocation of the same process, else the running one.

After its end an invocation waits `settle_s` (journal time) for late lines: journald relays a
service's stdout through a stream that can lag behind PID 1's own messages (seen on systemd
252: a crash's last lines logged after "Failed with result"). The next start of the unit cuts
the wait to `settle_after_start_s`.

Memory is bounded whatever the invocation's length: the first lines, the last lines and the
*latest* lines that look like errors or tracebacks, per process, are kept; everything else is
only counted (`dropped_lines`), so the traceback printed at the end always survives a long run.
Each of the three is bounded in lines and in bytes (`max_invocation_bytes`: head 1/8, tail 3/8,
error lines 1/2), so long lines keep fewer of them and an open invocation's memory is bounded
whatever its lines' length.
"""

from __future__ import annotations

import itertools
import re
import sys
import time
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import re2

from ..config import TrackerConfig
from ..environment.serving import is_serving_line
from ..journal.cursor import monotonic_seconds_between
from ..model import (
    Ending,
    Invocation,
    JournalEntry,
    LifecycleEvent,
    LogLine,
    field_int,
)

# Lines worth keeping past the head and tail caps: errors, tracebacks and their frames.
_IMPORTANT = re.compile(
    r"Traceback|Error|ERROR|error:|Exception|CRITICAL|FATAL|Fatal|File \"|raise |"
    r"died|[Kk]illed|signal|NCCL WARN|assert|Xid|No such file|not found|[Ff]ailed|Abort|"
    r"Segmentation|core dumped|does not match|not supported|out of memory|panicked|terminate",
)
_FRAME = re.compile(r'^\s*(?:\S.*\s)?File "')
_FRAME_LITERAL = 'File "'  # every match of _FRAME contains it: a cheap exact pre-check


def _important_re2() -> Any:
    options = re2.Options()
    options.encoding = re2.Options.Encoding.LATIN1  # bytes in, one character per byte
    options.never_capture = True
    return re2.compile(_IMPORTANT.pattern.encode(), options=options)


# The same alternation of ASCII literals, run by RE2 over many lines joined: Python's `re` tries
# every alternative at every position (~20 us for a 300-character line); RE2's automaton reads
# each byte once. On UTF-8 bytes an ASCII literal matches exactly where it matches in the str.
_IMPORTANT_BYTES = _important_re2()

# Plain strings: an enum member's `.value` is a property call, and these are read per entry.
_SUPPRESSED: str = LifecycleEvent.SUPPRESSED.value
_STARTING: str = LifecycleEvent.STARTING.value
_STARTED: str = LifecycleEvent.JOB_STARTED.value
_STOPPING: str = LifecycleEvent.STOPPING.value
_STOPPED: str = LifecycleEvent.JOB_STOPPED.value
_EXITED: str = LifecycleEvent.PROCESS_EXITED.value
_OOM: str = LifecycleEvent.OOM_KILLED.value
_RESTART: str = LifecycleEvent.RESTART_SCHEDULED.value
_FAILED: str = LifecycleEvent.UNIT_FAILED.value
_DEACTIVATED: str = LifecycleEvent.DEACTIVATED.value
_SKIPPED: str = LifecycleEvent.CONDITION_SKIPPED.value
_ENDS = frozenset({_FAILED, _DEACTIVATED, _SKIPPED})
_MAIN_COMMANDS = frozenset({"", "ExecStart"})  # COMMAND= of the main process (absent: older)
# PID 1's line (no MESSAGE_ID) for `systemctl kill`: "U: Sent signal SIGKILL to main process
# 85 (sleep) on client request." Only signals that end a process by default count, and only
# for an end soon after: a SIGHUP or SIGUSR1 sent for a reload is no stop.
_KILL_REQUEST = re.compile(
    r"Sent signal SIG(?:KILL|TERM|INT|QUIT|ABRT) to main process \d+ .*on client request"
)
_KILL_TO_END_US = 60_000_000

_Row = tuple[int, str, int | None, int | None, int]  # seq, text, pid, priority, realtime_us
Key = tuple[str, str | None]  # (machine id or "", unit)

# What a kept line costs besides its text (CPython 3.11): its row's tuple and the ints in it,
# and its slot in a list or deque.
ROW_BYTES = 176
_NO_BYTE_LIMIT = 1 << 62

_PIDS_REMEMBERED = 64  # per invocation: which processes' id-less lines belong to it
_CLOSED_REMEMBERED = 256  # per unit and host: ids already returned, whose late entries drop
_MAX_PROCESSES = 64  # per invocation: processes whose error lines are kept apart


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


def line_cost(text: str) -> int:
    """The bytes a kept line holds: its text as the interpreter stores it (1, 2 or 4 bytes a
    character: a cut line's "…" makes it 2) and its row."""
    return sys.getsizeof(text) + ROW_BYTES


@dataclass(slots=True)
class _Kept:
    """The latest lines worth keeping of each process, within a total bound in lines and in
    bytes (a ring, not the first N): the traceback at the end of a long run survives the
    request errors before it."""

    limit: int
    byte_limit: int = _NO_BYTE_LIMIT
    count: int = 0
    size: int = 0  # bytes, as line_cost counts them
    by_pid: OrderedDict[int | None, deque[_Row]] = field(default_factory=OrderedDict)
    size_by_pid: dict[int | None, int] = field(default_factory=dict)

    def add(self, row: _Row) -> None:
        pid = row[2]
        cost = line_cost(row[1])
        rows = self.by_pid.get(pid)
        if rows is None:
            if len(self.by_pid) >= _MAX_PROCESSES:
                quiet, gone = self.by_pid.popitem(last=False)  # the process quiet the longest
                self.count -= len(gone)
                self.size -= self.size_by_pid.pop(quiet)
            rows = self.by_pid[pid] = deque()
            self.size_by_pid[pid] = 0
        else:
            self.by_pid.move_to_end(pid)
        rows.append(row)
        self.count += 1
        self.size += cost
        self.size_by_pid[pid] += cost
        # Take the oldest line of the process that holds the most (lines, or bytes): one chatty
        # process cannot push another's final traceback out.
        if self.count > self.limit:
            self._drop_oldest(max(self.by_pid, key=lambda p: len(self.by_pid[p])))
        while self.size > self.byte_limit:
            self._drop_oldest(max(self.size_by_pid, key=self.size_by_pid.__getitem__))

    def _drop_oldest(self, pid: int | None) -> None:
        row = self.by_pid[pid].popleft()
        cost = line_cost(row[1])
        self.count -= 1
        self.size -= cost
        self.size_by_pid[pid] -= cost

    def rows(self) -> Iterator[_Row]:
        for rows in self.by_pid.values():
            yield from rows


@dataclass(slots=True)
class _Builder:
    """The mutable state of one invocation until it is returned."""

    unit: str | None
    invocation_id: str | None
    host: str | None
    hostname: str | None
    boot_id: str | None
    caps: TrackerConfig
    first_cursor: str | None = None
    started_us: int | None = None
    restarts: int = 0
    head: list[_Row] = field(default_factory=list)
    tail: deque[_Row] = field(default_factory=deque)
    kept: _Kept = field(default_factory=lambda: _Kept(limit=2000))
    head_budget: int = _NO_BYTE_LIMIT  # bytes (as line_cost counts them) of the head, the tail
    tail_budget: int = _NO_BYTE_LIMIT
    head_bytes: int = 0
    tail_bytes: int = 0
    head_open: bool = True  # until a line does not fit: the head is the first lines, unbroken
    total: int = 0
    suppressed: int = 0
    exit_code: str | None = None
    exit_status: int | None = None
    result: str | None = None
    oom_killed: bool = False
    ending: Ending | None = None  # None while it runs
    stop_requested: bool = False
    kill_requested_us: int | None = None  # `systemctl kill` (a person, a tool) signalled it
    main_started: bool = False
    start_seen: bool = False  # PID 1's "Starting"/"Started" of it was read
    control_killed: bool = False  # a control process (the gate) was killed before the main ran
    served_us: int | None = None
    end_message: str | None = None
    restart_of: str | None = None
    restart_scheduled: int | None = None
    ended_us: int | None = None
    deadline_us: int | None = None  # journal time after which it is decided (once ended)
    read_deadline: float | None = None  # the same, in the reader's clock (a quiet journal)
    end_read: float | None = None  # when its end was read (reader's clock)
    last_cursor: str | None = None
    end_cursor: str | None = None  # PID 1's entry that ended it
    last_us: int = 0
    pids: set[int] = field(default_factory=set)
    _after_frame: set[int | None] = field(default_factory=set)
    _matches: dict[int, bool] = field(default_factory=dict)  # seq -> _IMPORTANT matched

    def killed_on_request(self, end_us: int) -> bool:
        """Did a person's or a tool's kill request end it (the end came soon after)?"""
        requested = self.kill_requested_us
        return requested is not None and 0 <= end_us - requested <= _KILL_TO_END_US

    def add_line(self, seq: int, entry: JournalEntry) -> None:
        row: _Row = (seq, entry.message, entry.pid, entry.priority, entry.realtime_us)
        self.total += 1
        self.last_cursor = entry.cursor
        if entry.realtime_us > self.last_us:
            self.last_us = entry.realtime_us
        pid = entry.pid
        if pid is not None and pid not in self.pids and len(self.pids) < _PIDS_REMEMBERED:
            self.pids.add(pid)
        if self.served_us is None and is_serving_line(entry.message):
            self.served_us = entry.realtime_us
        cost = line_cost(entry.message)
        if self.head_open:
            if len(self.head) < self.caps.head_lines and self.head_bytes + cost <= self.head_budget:
                self.head.append(row)
                self.head_bytes += cost
                return
            self.head_open = False
        tail = self.tail
        tail.append(row)
        self.tail_bytes += cost
        if len(tail) > self.caps.tail_lines:
            self._leave_tail()
        while self.tail_bytes > self.tail_budget and len(tail) > 1:
            self._leave_tail()

    def _leave_tail(self) -> None:
        row = self.tail.popleft()
        self.tail_bytes -= line_cost(row[1])
        self._keep_if_important(row)

    def _keep_if_important(self, row: _Row) -> None:
        """Decide, as a line leaves the tail window, whether it stays."""
        _, text, pid, priority, _ = row
        # The line after a traceback frame is its source code (the crash site): keep it too.
        after_frame = pid in self._after_frame
        if _FRAME_LITERAL in text and _FRAME.search(text) is not None:
            self._after_frame.add(pid)
        elif after_frame:
            self._after_frame.discard(pid)
        if len(self._after_frame) > _MAX_PROCESSES:
            self._after_frame.clear()
        low = priority if priority is not None else 7
        if after_frame or low <= 3:
            self._matches.pop(row[0], None)
            self.kept.add(row)
            return
        # _matches_important's cached answer, inline (this runs for nearly every line).
        matched = self._matches.pop(row[0], None)
        if matched is None:
            matched = self._matches_important(row)
        if matched:
            self.kept.add(row)

    def _matches_important(self, row: _Row) -> bool:
        """`_IMPORTANT.search(row text)`, computed for the whole tail at once when needed."""
        matched = self._matches.pop(row[0], None)
        if matched is not None:
            return matched
        # `row` just left the tail; every row still in it leaves later, each exactly once.
        rows = [row, *self.tail]
        flags = _important_flags([r[1] for r in rows])
        self._matches = {r[0]: flag for r, flag in zip(rows[1:], flags[1:], strict=True)}
        return flags[0]

    def touch(self, entry: JournalEntry) -> None:
        """Account for one of PID 1's messages about it (not a line)."""
        self.last_cursor = entry.cursor
        if entry.realtime_us > self.last_us:
            self.last_us = entry.realtime_us

    def build(self, ending: Ending) -> Invocation:
        rows = sorted({r[0]: r for r in (*self.head, *self.kept.rows(), *self.tail)}.values())
        lines = tuple(
            LogLine(text=text, pid=pid, priority=prio, realtime_us=ts)
            for _, text, pid, prio, ts in rows
        )
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


@dataclass(slots=True)
class _Track:
    """One unit on one machine: its invocations in flight and the ids already returned."""

    running: dict[str | None, _Builder] = field(default_factory=dict)  # not ended, by id
    settling: dict[str | None, _Builder] = field(default_factory=dict)  # ended, late lines
    closed: OrderedDict[str, tuple[int | None, int | None]] = field(default_factory=OrderedDict)
    restarts: int = 0  # the last restart counter systemd logged
    pending_restart_of: str | None = None  # an ended invocation whose restart was scheduled
    boot_id: str | None = None

    def builder_of(self, invocation_id: str | None) -> _Builder | None:
        return self.running.get(invocation_id) or self.settling.get(invocation_id)

    def newest_running(self) -> _Builder | None:
        return next(reversed(self.running.values()), None)


class InvocationTracker:
    """Feeds on journal entries; returns each invocation as it ends, exactly once."""

    def __init__(
        self, caps: TrackerConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.caps = caps or TrackerConfig()
        self._clock = clock
        self._tracks: dict[Key, _Track] = {}
        self._seq = itertools.count()
        self._settle_us = int(self.caps.settle_s * 1_000_000)
        self._after_start_us = int(self.caps.settle_after_start_s * 1_000_000)
        self._settling = 0  # builders waiting for late lines, over all tracks
        self._notices: list[SuppressionNotice] = []
        self.late_lines = 0  # lines of invocations already returned (dropped)
        # The fast path's memo: the track and invocation of the last service line.
        self._last: tuple[str | None, str | None, str | None, _Builder] | None = None

    # -- feeding ----------------------------------------------------------------------------

    def feed(self, entry: JournalEntry) -> list[Invocation]:
        """Account for one entry; return the invocations it ended (usually none)."""
        last = self._last
        if (
            last is not None
            and not self._settling
            and not entry.from_pid1
            and entry.unit == last[0]
            and entry.host == last[1]
            and entry.invocation_id == last[2]
            and entry.message_id != _SUPPRESSED
            and (entry.boot_id is None or entry.boot_id == last[3].boot_id)
        ):
            # The common case, ahead of the general path below (which it agrees with): one more
            # line of the running invocation, nothing ending or waiting for late lines.
            last[3].add_line(next(self._seq), entry)
            return []
        key: Key = (entry.host or "", entry.unit)
        track = self._tracks.get(key)
        if track is None:
            track = self._tracks[key] = _Track()
        ended: list[Invocation] = []
        if self._settling:
            if not entry.from_pid1 and entry.message_id != _SUPPRESSED:
                self._still_writing(track, entry)
            ended += self._flush_track(key, track, entry.realtime_us)
        if entry.boot_id is not None and entry.boot_id != track.boot_id:
            ended += self._new_boot(key, track, entry.boot_id)
        if entry.message_id == _SUPPRESSED:
            self._suppressed(key, track, entry)
        elif entry.from_pid1:
            ended += self._lifecycle(key, track, entry)
        else:
            ended += self._line(key, track, entry)
        return ended

    def _line(self, key: Key, track: _Track, entry: JournalEntry) -> list[Invocation]:
        invocation_id = entry.invocation_id
        ended: list[Invocation] = []
        if invocation_id is None:
            builder = self._owner_of_anonymous(track, entry.pid)
        elif (owner := self._ended_owner(track, entry)) is not None:
            builder = owner
        else:
            if invocation_id in track.closed:
                self.late_lines += 1
                return []
            builder = track.builder_of(invocation_id)
            if builder is None:
                unnamed = track.running.get(None)
                if unnamed is not None:
                    # journald reads the id from the cgroup and can miss it on a line printed
                    # as a process exits: the unnamed invocation is this one, now named.
                    builder = self._name(track, unnamed, invocation_id)
                else:
                    ended += self._supersede(key, track, invocation_id)
                    self._cut_settling(track, invocation_id, entry.realtime_us)
                    builder = self._begin(key, track, entry)
        if builder is None:
            builder = self._begin(key, track, entry)
        builder.add_line(next(self._seq), entry)
        if builder.ending is None and builder.invocation_id == invocation_id:
            self._last = (entry.unit, entry.host, invocation_id, builder)
        return ended

    def _owner_of_anonymous(self, track: _Track, pid: int | None) -> _Builder | None:
        """A line without an invocation id: its process's invocation, else the running one."""
        if pid is not None:
            for builder in (*track.running.values(), *track.settling.values()):
                if pid in builder.pids:
                    return builder
        return track.newest_running() or next(reversed(track.settling.values()), None)

    def _lifecycle(self, key: Key, track: _Track, entry: JournalEntry) -> list[Invocation]:
        event = entry.message_id
        invocation_id = entry.invocation_id
        fields = entry.fields
        if event == _RESTART:
            track.restarts = field_int(fields.get("N_RESTARTS")) or 0
            track.pending_restart_of = invocation_id
            builder = track.builder_of(invocation_id)
            if builder is not None:
                builder.restart_scheduled = track.restarts
                builder.touch(entry)
            return []
        if event == _FAILED and fields.get("UNIT_RESULT") == "start-limit-hit":
            return self._start_limit(key, track, entry)
        stop_job = event == _STOPPED and fields.get("JOB_TYPE") == "stop"
        if stop_job and track.pending_restart_of == invocation_id:
            track.pending_restart_of = None  # a stop job cancelled the pending restart
        if invocation_id is not None and invocation_id in track.closed:
            return []
        if event is None and _KILL_REQUEST.search(entry.message):
            killed = track.builder_of(invocation_id)
            if killed is not None and killed.ending is None:
                killed.kill_requested_us = entry.realtime_us
            return []
        if event not in _KNOWN_EVENTS:
            return []
        ended: list[Invocation] = []
        builder = track.builder_of(invocation_id)
        if event == _STARTING or (event == _STARTED and builder is None):
            ended += self._next_start(key, track, invocation_id, entry)
            builder = track.builder_of(invocation_id)
        if builder is None:
            if event in (_STOPPED, _STOPPING):
                return ended  # about an invocation this journal never showed
            if invocation_id is not None and None in track.running:
                builder = self._name(track, track.running[None], invocation_id)
            else:
                ended += self._supersede(key, track, invocation_id)
                builder = self._begin(key, track, entry)
        builder.touch(entry)
        if event in (_STARTING, _STARTED):
            builder.start_seen = True
        if builder.ending is not None or event == _STARTING:
            return ended  # already ended (only waiting for late lines), or just begun
        if event == _STARTED:
            # The same MESSAGE_ID says "Condition check resulted in U being skipped." (skipped).
            builder.main_started = fields.get("JOB_RESULT") in (None, "done")
        elif event == _STOPPING:
            builder.stop_requested = True
        elif event == _EXITED:
            self._exited(builder, entry)
        elif event == _OOM:
            builder.oom_killed = True
            builder.end_message = _without_unit(entry.message, builder.unit)
        elif event == _STOPPED:
            # "Stopped" without "Failed"/"Deactivated" first: the stop job's end is its end.
            ended += self._end(key, track, builder, entry, None)
        else:  # _ENDS
            ended += self._end(key, track, builder, entry, fields.get("UNIT_RESULT"))
        return ended

    def _exited(self, builder: _Builder, entry: JournalEntry) -> None:
        fields = entry.fields
        command = fields.get("COMMAND", "")
        code, status = fields.get("EXIT_CODE"), field_int(fields.get("EXIT_STATUS"))
        if command in _MAIN_COMMANDS:
            builder.main_started = True
            builder.exit_code, builder.exit_status = code, status
            if not builder.oom_killed:
                builder.end_message = _without_unit(entry.message, builder.unit)
        elif code == "killed" and not builder.main_started:
            builder.control_killed = True  # e.g. the gate, killed by a stop job

    def _end(
        self, key: Key, track: _Track, builder: _Builder, entry: JournalEntry, result: str | None
    ) -> list[Invocation]:
        event = entry.message_id
        builder.result = result or ("success" if event == _DEACTIVATED else builder.result)
        builder.ended_us = entry.realtime_us
        builder.end_cursor = entry.cursor
        if event == _SKIPPED:
            builder.ending = Ending.SKIPPED
        elif builder.control_killed and not builder.main_started:
            builder.ending = Ending.GATE_STOPPED
        elif builder.stop_requested or builder.killed_on_request(entry.realtime_us):
            builder.ending = Ending.STOPPED
        else:
            builder.ending = Ending.EXITED
        track.running.pop(builder.invocation_id, None)
        if self._settle_us <= 0 or builder.ending is Ending.SKIPPED:
            # Those that ended before it are returned first: decisions stay in journal order.
            earlier = [self._close(track, b) for b in list(track.settling.values())]
            return [*earlier, self._close(track, builder)]
        builder.end_read = self._clock()
        builder.deadline_us = entry.realtime_us + self._settle_us
        builder.read_deadline = builder.end_read + self.caps.settle_s
        track.settling[builder.invocation_id] = builder
        self._settling += 1
        return []

    def _next_start(
        self, key: Key, track: _Track, invocation_id: str | None, entry: JournalEntry
    ) -> list[Invocation]:
        """A start job began ("Starting U..."): a new invocation, and the last one is done."""
        ended = self._supersede(key, track, invocation_id)
        self._cut_settling(track, invocation_id, entry.realtime_us)
        if track.builder_of(invocation_id) is None:
            if invocation_id is not None and None in track.running:
                builder = self._name(track, track.running[None], invocation_id)
            else:
                builder = self._begin(key, track, entry)
            # systemd counts automatic restarts only; any other start resets NRestarts to 0.
            builder.restart_of = track.pending_restart_of
            builder.restarts = track.restarts if builder.restart_of is not None else 0
            track.restarts = builder.restarts
        track.pending_restart_of = None
        return ended

    def _ended_owner(self, track: _Track, entry: JournalEntry) -> _Builder | None:
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
        stated = track.builder_of(entry.invocation_id)
        if stated is None or stated.ending is not None:
            return stated
        if stated.main_started or entry.pid is None or entry.pid in stated.pids:
            return None
        return next((b for b in track.settling.values() if entry.pid in b.pids), None)

    def _still_writing(self, track: _Track, entry: JournalEntry) -> None:
        """A line of an invocation that already ended: journald is still writing what its
        processes printed (a flood just before a crash takes it seconds, and the cause comes
        last), so its decision waits for more, up to `drain_max_s` after its end."""
        builder = (
            self._ended_owner(track, entry)
            if entry.invocation_id is not None
            else self._owner_of_anonymous(track, entry.pid)
        )
        if (
            builder is None
            or builder.ending is None
            or builder.ended_us is None
            or builder.end_read is None
        ):
            return
        drain_us = int(self.caps.drain_max_s * 1_000_000)
        limit_us = builder.ended_us + drain_us
        builder.deadline_us = min(
            max(builder.deadline_us or 0, entry.realtime_us + self._settle_us), limit_us
        )
        limit = builder.end_read + self.caps.drain_max_s
        soon = self._clock() + self.caps.settle_s
        builder.read_deadline = min(max(builder.read_deadline or 0.0, soon), limit)

    def _cut_settling(self, track: _Track, invocation_id: str | None, now_us: int) -> None:
        """A newer invocation began: the ended ones' processes are gone, wait only a little."""
        cut = now_us + self._after_start_us
        soon = self._clock() + self.caps.settle_after_start_s
        for builder in track.settling.values():
            if builder.invocation_id != invocation_id:
                builder.deadline_us = min(builder.deadline_us or cut, cut)
                builder.read_deadline = min(builder.read_deadline or soon, soon)

    def _supersede(self, key: Key, track: _Track, invocation_id: str | None) -> list[Invocation]:
        """A newer invocation appears: running ones with another id ended, their end unseen."""
        stale = [b for b in track.running.values() if b.invocation_id not in (None, invocation_id)]
        ended = [self._close(track, b, Ending.UNSEEN) for b in stale]
        if len(track.running) >= self.caps.max_open_invocations:
            oldest = next(iter(track.running.values()))
            ended.append(self._close(track, oldest, Ending.UNSEEN))
        return ended

    def _new_boot(self, key: Key, track: _Track, boot_id: str) -> list[Invocation]:
        """The host booted again: what ran in the old boot ended with it."""
        old = track.boot_id
        track.boot_id = boot_id
        if old is None:
            return []
        ended = [
            self._close(track, b, Ending.BOOT)
            for b in list(track.running.values())
            if b.boot_id not in (None, boot_id)
        ]
        ended += [
            self._close(track, b)
            for b in list(track.settling.values())
            if b.boot_id not in (None, boot_id)
        ]
        track.pending_restart_of = None
        track.restarts = 0
        return ended

    def _start_limit(self, key: Key, track: _Track, entry: JournalEntry) -> list[Invocation]:
        """systemd gave up restarting the unit: reported once, as an invocation of its own.

        PID 1 logs it about the last invocation (no new one was started), which has usually been
        returned already; one still in flight is returned first, as it ended.
        """
        ended: list[Invocation] = []
        builder = track.builder_of(entry.invocation_id)
        if builder is not None:
            ended.append(self._close(track, builder))
        track.pending_restart_of = None
        ended.append(
            Invocation(
                unit=key[1],
                invocation_id=None,
                lines=(),
                result="start-limit-hit",
                restarts=track.restarts,
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

    def _suppressed(self, key: Key, track: _Track, entry: JournalEntry) -> None:
        """journald's "Suppressed N messages": count them where they were lost."""
        dropped = field_int(entry.fields.get("N_DROPPED")) or 0
        if dropped <= 0:
            return
        after = entry.fields.get("OBJECT_SYSTEMD_INVOCATION_ID")
        # The notice comes with the first line after the interval, often a later invocation's
        # ("after"): the lines were lost from the invocations that logged before it.
        candidates = [
            b
            for b in (*track.settling.values(), *track.running.values())
            if b.invocation_id != after
        ]
        if candidates:
            candidates[-1].suppressed += dropped
            return
        window_us = int(self.caps.ratelimit_interval_s * 1_000_000)
        since = entry.realtime_us - window_us
        ids = tuple(
            inv_id
            for inv_id, (started, ended) in track.closed.items()
            if (ended or started or 0) >= since and inv_id != after
        )
        running = track.builder_of(after)
        if not ids and running is not None:
            running.suppressed += dropped  # its own lines, then
            return
        self._notices.append(
            SuppressionNotice(
                unit=key[1],
                host=entry.host,
                dropped=dropped,
                invocation_ids=ids,
                realtime_us=entry.realtime_us,
            )
        )

    def _begin(self, key: Key, track: _Track, entry: JournalEntry) -> _Builder:
        caps = self.caps
        builder = _Builder(
            unit=key[1],
            invocation_id=entry.invocation_id,
            host=entry.host,
            hostname=entry.hostname,
            boot_id=entry.boot_id,
            caps=caps,
            first_cursor=entry.cursor,
            started_us=entry.realtime_us,
            restarts=track.restarts,
            kept=_Kept(limit=caps.max_error_lines, byte_limit=caps.max_invocation_bytes // 2),
            head_budget=caps.max_invocation_bytes // 8,
            tail_budget=caps.max_invocation_bytes * 3 // 8,
        )
        builder.touch(entry)
        track.running[entry.invocation_id] = builder
        return builder

    def _name(self, track: _Track, builder: _Builder, invocation_id: str) -> _Builder:
        del track.running[None]
        builder.invocation_id = invocation_id
        track.running[invocation_id] = builder
        return builder

    def _close(self, track: _Track, builder: _Builder, ending: Ending | None = None) -> Invocation:
        """Return `builder` as an ended invocation; it is forgotten except for its id."""
        if track.running.get(builder.invocation_id) is builder:
            del track.running[builder.invocation_id]
        if track.settling.get(builder.invocation_id) is builder:
            del track.settling[builder.invocation_id]
            self._settling -= 1
        if self._last is not None and self._last[3] is builder:
            self._last = None
        if builder.invocation_id is not None:
            track.closed[builder.invocation_id] = (builder.started_us, builder.ended_us)
            while len(track.closed) > _CLOSED_REMEMBERED:
                track.closed.popitem(last=False)
        final = ending or builder.ending or Ending.UNSEEN
        if builder.ended_us is None and final is not Ending.OPEN:
            builder.ended_us = builder.last_us or None
        return builder.build(final)

    # -- time passing -------------------------------------------------------------------------

    def _flush_track(self, key: Key, track: _Track, now_us: int) -> list[Invocation]:
        if not track.settling:
            return []
        due = [b for b in track.settling.values() if (b.deadline_us or 0) <= now_us]
        return [self._close(track, b) for b in due]

    def flush_due(self, now_us: int) -> list[Invocation]:
        """Ended invocations whose late-line window has passed by journal time `now_us`."""
        ended: list[Invocation] = []
        for key, track in self._tracks.items():
            ended += self._flush_track(key, track, now_us)
        return ended

    def flush_quiet(self, now: float | None = None) -> list[Invocation]:
        """Ended invocations whose window has passed on the reader's clock (a quiet journal)."""
        now = self._clock() if now is None else now
        ended: list[Invocation] = []
        for track in self._tracks.values():
            due = [b for b in track.settling.values() if (b.read_deadline or 0.0) <= now]
            ended += [self._close(track, b) for b in due]
        return ended

    def flush_drained(self, host: str, read_before: float) -> list[Invocation]:
        """Ended invocations of `host` whose end was read before `read_before` (reader's
        clock), decided before their window ends: the caller knows that every line their
        processes printed had reached the journal by then and has been read since."""
        ended: list[Invocation] = []
        for (track_host, _), track in self._tracks.items():
            if track_host != host:
                continue
            due = [
                b
                for b in track.settling.values()
                if b.end_read is not None and b.end_read <= read_before
            ]
            ended += [self._close(track, b) for b in due]
        return ended

    def settling_on(self, host: str) -> bool:
        """Does an ended invocation of `host` wait for late lines?"""
        return any(
            track.settling for (track_host, _), track in self._tracks.items() if track_host == host
        )

    def next_deadline(self) -> float | None:
        """When the next ended invocation becomes ready (reader's clock), if any is waiting."""
        deadlines = [
            b.read_deadline
            for track in self._tracks.values()
            for b in track.settling.values()
            if b.read_deadline is not None
        ]
        return min(deadlines, default=None)

    # -- ending on demand ------------------------------------------------------------------

    def close(
        self,
        unit: str | None,
        host: str | None,
        invocation_id: str | None,
        ending: Ending,
        *,
        end_message: str | None = None,
    ) -> Invocation | None:
        """End a running invocation now (the daemon saw its engine hang, or its server exit
        under RemainAfterExit=: `end_message` says how); None if not running."""
        track = self._tracks.get((host or "", unit))
        if track is None:
            return None
        builder = track.running.get(invocation_id) or (
            track.newest_running() if invocation_id is None else None
        )
        if builder is None:
            return None
        if end_message is not None:
            builder.end_message = end_message
        return self._close(track, builder, ending)

    def close_all(self) -> list[Invocation]:
        """End every invocation (the end of a saved journal): settling ones as they ended,
        running ones as still open."""
        ended: list[Invocation] = []
        for track in self._tracks.values():
            ended += [self._close(track, b) for b in list(track.settling.values())]
            ended += [self._close(track, b, Ending.OPEN) for b in list(track.running.values())]
        return ended

    # -- views ---------------------------------------------------------------------------------

    def open_invocation(self, unit: str | None, host: str | None = None) -> Invocation | None:
        """A snapshot of a unit's running invocation, without ending it."""
        for (track_host, name), track in self._tracks.items():
            if name == unit and (host is None or track_host == (host or "")):
                builder = track.newest_running()
                if builder is not None:
                    return builder.build(Ending.OPEN)
        return None

    def has_seen(self, unit: str | None, invocation_id: str) -> bool:
        """True once an entry of that invocation of `unit` was read (on any host)."""
        for (_, name), track in self._tracks.items():
            if name == unit and (
                track.builder_of(invocation_id) is not None or invocation_id in track.closed
            ):
                return True
        return False

    def settling(self, unit: str | None) -> bool:
        """True while an ended invocation of `unit` still waits for its late lines."""
        return any(name == unit and track.settling for (_, name), track in self._tracks.items())

    def take_notices(self) -> list[SuppressionNotice]:
        """journald's late reports of lost lines, since the last call."""
        notices, self._notices = self._notices, []
        return notices

    def replay_from(self) -> str | None:
        """The first cursor of the oldest invocation in flight: where a restart re-reads from."""
        builders = [
            b
            for track in self._tracks.values()
            for b in (*track.running.values(), *track.settling.values())
            if b.first_cursor is not None
        ]
        if not builders:
            return None
        return min(builders, key=lambda b: b.started_us or 0).first_cursor


_KNOWN_EVENTS = frozenset(
    {_STARTING, _STARTED, _STOPPING, _STOPPED, _EXITED, _OOM, _FAILED, _DEACTIVATED, _SKIPPED}
)


def _important_flags(texts: Sequence[str]) -> list[bool]:
    """For each text, whether `_IMPORTANT` matches it; one RE2 pass over all of them."""
    encoded = [text.encode("utf-8", "surrogatepass") for text in texts]
    starts = list(itertools.accumulate((len(b) + 1 for b in encoded[:-1]), initial=0))
    flags = [False] * len(texts)
    # No alternative contains a NUL byte, so no match spans two texts.
    for match in _IMPORTANT_BYTES.finditer(b"\x00".join(encoded)):
        flags[bisect_right(starts, match.start()) - 1] = True
    return flags


def _without_unit(message: str, unit: str | None) -> str:
    """PID 1's text without its "unit: " prefix (the unit is named elsewhere)."""
    prefix = f"{unit}: "
    return message[len(prefix) :] if unit and message.startswith(prefix) else message
