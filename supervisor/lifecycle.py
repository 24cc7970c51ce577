"""The invocation tracker: groups journal entries into starts of a unit and sees each one end.

An invocation is one start of a unit, named by systemd's invocation id (`_SYSTEMD_INVOCATION_ID`
on the service's lines, `INVOCATION_ID` on PID 1's messages about it). It ends on PID 1's
lifecycle messages, recognised by MESSAGE_ID and never by their text: "Failed with result" or
"Deactivated successfully" (after "Main process exited" gave the exit code), an OOM kill, a skipped
start, or, failing those, the first entry of the unit's next invocation.

Memory is bounded whatever the invocation's length: the first lines, the last lines and the lines
that look like errors or tracebacks are kept; everything else is only counted.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import re2

from supervisor.config import TrackerConfig
from supervisor.model import Invocation, JournalEntry, LifecycleEvent, LogLine, field_int

# Lines worth keeping past the head and tail caps: errors, tracebacks and their frames.
_IMPORTANT = re.compile(
    r"Traceback|Error|ERROR|error:|Exception|CRITICAL|FATAL|Fatal|File \"|raise |"
    r"died|[Kk]illed|signal|NCCL WARN|assert|Xid|No such file|not found|[Ff]ailed|Abort|"
    r"Segmentation|core dumped|does not match|not supported|out of memory",
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
_START_LIMIT = "Start request repeated too quickly"
# Plain strings: an enum member's `.value` is a property call, and these are read per entry.
_SUPPRESSED: str = LifecycleEvent.SUPPRESSED.value
_JOB_STARTED: str = LifecycleEvent.JOB_STARTED.value
_ENDING = {
    LifecycleEvent.UNIT_FAILED.value,
    LifecycleEvent.DEACTIVATED.value,
    LifecycleEvent.CONDITION_SKIPPED.value,
}

_Row = tuple[int, str, int | None, int | None, int]  # seq, text, pid, priority, realtime_us


@dataclass(slots=True)
class _Builder:
    """The mutable state of one open invocation."""

    unit: str | None
    invocation_id: str | None
    caps: TrackerConfig
    first_cursor: str | None = None
    started_us: int | None = None
    restarts: int = 0
    head: list[_Row] = field(default_factory=list)
    tail: deque[_Row] = field(default_factory=deque)
    important: list[_Row] = field(default_factory=list)
    total: int = 0
    suppressed: int = 0
    exit_code: str | None = None
    exit_status: int | None = None
    result: str | None = None
    oom_killed: bool = False
    skipped: bool = False
    settle_deadline_us: int | None = None  # set once ended: late lines are still taken until then
    last_cursor: str | None = None
    ended_us: int | None = None
    _after_frame: set[int | None] = field(default_factory=set)
    _matches: dict[int, bool] = field(default_factory=dict)  # seq -> _IMPORTANT matched

    def add_line(self, seq: int, entry: JournalEntry) -> None:
        row: _Row = (seq, entry.message, entry.pid, entry.priority, entry.realtime_us)
        self.total += 1
        if len(self.head) < self.caps.head_lines:
            self.head.append(row)
            return
        self.tail.append(row)
        if len(self.tail) > self.caps.tail_lines:
            self._keep_if_important(self.tail.popleft())

    def _keep_if_important(self, row: _Row) -> None:
        """Decide, as a line leaves the tail window, whether it stays."""
        _, text, pid, priority, _ = row
        # The line after a traceback frame is its source code (the crash site): keep it too.
        after_frame = pid in self._after_frame
        if _FRAME_LITERAL in text and _FRAME.search(text) is not None:
            self._after_frame.add(pid)
        elif after_frame:
            self._after_frame.discard(pid)
        if len(self.important) >= self.caps.max_error_lines:
            return
        low = priority if priority is not None else 7
        if after_frame or low <= 3:
            self.important.append(row)
            return
        # _matches_important's cached answer, inline (this runs for nearly every line).
        matched = self._matches.pop(row[0], None)
        if matched is None:
            matched = self._matches_important(row)
        if matched:
            self.important.append(row)

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

    def build(self) -> Invocation:
        rows = sorted({r[0]: r for r in (*self.head, *self.important, *self.tail)}.values())
        lines = tuple(
            LogLine(text=text, pid=pid, priority=prio, realtime_us=ts)
            for _, text, pid, prio, ts in rows
        )
        return Invocation(
            unit=self.unit,
            invocation_id=self.invocation_id,
            lines=lines,
            total_lines=self.total,
            dropped_lines=self.total - len(lines),
            suppressed_lines=self.suppressed,
            exit_code=self.exit_code,
            exit_status=self.exit_status,
            result="exec-condition" if self.skipped else self.result,
            restarts=self.restarts,
            oom_killed=self.oom_killed,
            started_us=self.started_us,
            ended_us=self.ended_us,
            first_cursor=self.first_cursor,
            last_cursor=self.last_cursor,
        )


class InvocationTracker:
    """Feeds on journal entries; returns each invocation as it ends."""

    def __init__(self, caps: TrackerConfig | None = None) -> None:
        self.caps = caps or TrackerConfig()
        self._open: dict[str | None, _Builder] = {}  # by unit: one running invocation each
        self._restarts: dict[str | None, int] = {}
        self._seq = itertools.count()
        # journald relays a service's stdout through a stream that can lag behind PID 1's own
        # "Failed with result" message: an ended invocation still takes its late lines for this
        # long (journal time) before it is decided.
        self._settle_us = int(self.caps.settle_s * 1_000_000)
        self._ending: dict[str | None, int] = {}  # unit -> settle deadline (journal time, us)

    def feed(self, entry: JournalEntry) -> list[Invocation]:
        """Account for one entry; return the invocations it ended (usually none)."""
        unit = entry.unit
        current = self._open.get(unit)
        if (
            current is not None
            and not self._ending
            and entry.invocation_id == current.invocation_id
            and not entry.from_pid1
            and entry.message_id != _SUPPRESSED
        ):
            # The common case, ahead of the general path below (which it agrees with): one more
            # line of the running invocation, nothing ending or waiting for late lines.
            current.add_line(next(self._seq), entry)
            current.last_cursor = entry.cursor
            return []
        ended: list[Invocation] = self.flush_due(entry.realtime_us) if self._ending else []
        if current is not None and current.settle_deadline_us is not None:
            same = entry.invocation_id in (None, current.invocation_id)
            if same and not entry.from_pid1 and not _is_unit_event(entry):
                current.add_line(next(self._seq), entry)  # a late line of the ended invocation
                current.last_cursor = entry.cursor
                return ended
            if not same or entry.message_id == _JOB_STARTED:
                ended.append(self._close(unit))
                current = None
        if (
            current is not None
            and entry.invocation_id is not None
            and current.invocation_id is not None
            and entry.invocation_id != current.invocation_id
        ):
            # A new start although the end of the last one was never seen (lost or not logged).
            ended.append(self._close(unit))
            current = None
        if current is not None and current.invocation_id is None and entry.invocation_id:
            # journald reads the id from the cgroup and can miss it on a line printed as a
            # process exits; the invocation is still the same one, now named.
            current.invocation_id = entry.invocation_id
        if entry.from_pid1 or _is_unit_event(entry):
            ended += self._lifecycle(entry, current)
            return ended
        builder = current or self._begin(entry)
        builder.add_line(next(self._seq), entry)
        builder.last_cursor = entry.cursor
        return ended

    def _lifecycle(self, entry: JournalEntry, current: _Builder | None) -> list[Invocation]:
        event = entry.message_id
        fields = entry.fields
        if event == LifecycleEvent.RESTART_SCHEDULED.value:
            self._restarts[entry.unit] = field_int(fields.get("N_RESTARTS")) or 0
            return []
        if event == LifecycleEvent.SUPPRESSED.value:
            if current is not None:
                current.suppressed += field_int(fields.get("N_DROPPED")) or 0
            return []
        if event not in _ENDING and event not in (
            LifecycleEvent.PROCESS_EXITED.value,
            LifecycleEvent.OOM_KILLED.value,
        ):
            return []
        if current is not None and current.settle_deadline_us is not None:
            return []  # already ended; only waiting for late lines
        builder = current or self._begin(entry)
        builder.last_cursor = entry.cursor
        if event == LifecycleEvent.PROCESS_EXITED.value:
            builder.exit_code = fields.get("EXIT_CODE")
            builder.exit_status = field_int(fields.get("EXIT_STATUS"))
            return []
        if event == LifecycleEvent.OOM_KILLED.value:
            builder.oom_killed = True
            return []
        builder.result = fields.get("UNIT_RESULT") or (
            "success" if event == LifecycleEvent.DEACTIVATED.value else None
        )
        builder.skipped = event == LifecycleEvent.CONDITION_SKIPPED.value
        builder.ended_us = entry.realtime_us
        if self._settle_us <= 0 or builder.skipped:
            return [self._close(entry.unit)]
        builder.settle_deadline_us = entry.realtime_us + self._settle_us
        self._ending[entry.unit] = builder.settle_deadline_us
        return []

    def flush_due(self, now_us: int) -> list[Invocation]:
        """Decide-ready invocations: ended, and their late-line window has passed."""
        due = [unit for unit, deadline in self._ending.items() if deadline <= now_us]
        return [self._close(unit) for unit in due]

    def next_deadline_us(self) -> int | None:
        """When the next ended invocation becomes ready (journal time), if any is waiting."""
        return min(self._ending.values(), default=None)

    def _begin(self, entry: JournalEntry) -> _Builder:
        builder = _Builder(
            unit=entry.unit,
            invocation_id=entry.invocation_id,
            caps=self.caps,
            first_cursor=entry.cursor,
            started_us=entry.realtime_us,
            restarts=self._restarts.get(entry.unit, 0),
        )
        self._open[entry.unit] = builder
        return builder

    def _close(self, unit: str | None) -> Invocation:
        self._ending.pop(unit, None)
        return self._open.pop(unit).build()

    def close(self, unit: str | None, *, hung: bool = False) -> Invocation | None:
        """End a unit's open invocation now (a hung engine, or the end of a saved journal)."""
        if unit not in self._open:
            return None
        invocation = self._close(unit)
        return dataclasses.replace(invocation, hung=True) if hung else invocation

    def close_all(self) -> list[Invocation]:
        """End every open invocation (the end of a saved journal)."""
        return [self._close(unit) for unit in list(self._open)]

    def open_units(self) -> list[str | None]:
        """Units with an invocation still running."""
        return list(self._open)

    def open_invocation(self, unit: str | None) -> Invocation | None:
        """A snapshot of a unit's running invocation, without ending it."""
        builder = self._open.get(unit)
        return builder.build() if builder is not None else None

    def replay_from(self) -> str | None:
        """The first cursor of the oldest open invocation: where a restart must re-read from."""
        starts = [b for b in self._open.values() if b.first_cursor is not None]
        if not starts:
            return None
        return min(starts, key=lambda b: b.started_us or 0).first_cursor


def _is_frame(text: str) -> bool:
    return _FRAME_LITERAL in text and _FRAME.search(text) is not None


def _important_flags(texts: Sequence[str]) -> list[bool]:
    """For each text, whether `_IMPORTANT` matches it; one RE2 pass over all of them."""
    encoded = [text.encode("utf-8", "surrogatepass") for text in texts]
    starts = list(itertools.accumulate((len(b) + 1 for b in encoded[:-1]), initial=0))
    flags = [False] * len(texts)
    # No alternative contains a NUL byte, so no match spans two texts.
    for match in _IMPORTANT_BYTES.finditer(b"\x00".join(encoded)):
        flags[bisect_right(starts, match.start()) - 1] = True
    return flags


def _is_unit_event(entry: JournalEntry) -> bool:
    # journald's "Suppressed N messages" is logged by journald, not PID 1, about the unit.
    return entry.message_id == _SUPPRESSED


def is_start_limit_hit(entry: JournalEntry) -> bool:
    """systemd's start-limit message has no MESSAGE_ID; its text is all there is."""
    return entry.from_pid1 and _START_LIMIT in entry.message
