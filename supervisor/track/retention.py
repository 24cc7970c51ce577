"""The lines an invocation keeps: bounded whatever its length, the crash's traceback always in.

The first lines (the head), the last lines (the tail) and the *latest* lines that look like
errors or tracebacks, per process, are kept; everything else is only counted, so the traceback
printed at the end always survives a long run. Each of the three is bounded in lines and in bytes
(`tracker.max_invocation_bytes`: head 1/8, tail 3/8, error lines 1/2), so long lines keep fewer of
them and an open invocation's memory is bounded whatever its lines' length.

Every line of every supervised unit passes `KeptLines.add`: rows are plain tuples, and whether a
line is worth keeping is decided as it leaves the tail, for the whole tail at once, by one RE2
pass (`_important_flags`).
"""

from __future__ import annotations

import itertools
import re
import sys
from bisect import bisect_right
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from typing import Any

import re2

from ..config import TrackerConfig
from ..model import LogLine

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

Row = tuple[int, str, int | None, int | None, int]  # seq, text, pid, priority, realtime_us

# What a kept line costs besides its text (CPython 3.11): its row's tuple and the ints in it,
# and its slot in a list or deque.
ROW_BYTES = 176
_MAX_PROCESSES = 64  # per invocation: processes whose error lines are kept apart


def line_cost(text: str) -> int:
    """The bytes a kept line holds: its text as the interpreter stores it (1, 2 or 4 bytes a
    character: a cut line's "…" makes it 2) and its row."""
    return sys.getsizeof(text) + ROW_BYTES


class _ErrorLines:
    """The latest lines worth keeping of each process, within a total bound in lines and in
    bytes (a ring, not the first N): the traceback at the end of a long run survives the
    request errors before it."""

    __slots__ = ("by_pid", "byte_limit", "count", "limit", "size", "size_by_pid")

    def __init__(self, limit: int, byte_limit: int) -> None:
        self.limit = limit
        self.byte_limit = byte_limit
        self.count = 0
        self.size = 0  # bytes, as line_cost counts them
        self.by_pid: OrderedDict[int | None, deque[Row]] = OrderedDict()
        self.size_by_pid: dict[int | None, int] = {}

    def add(self, row: Row) -> None:
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

    def rows(self) -> Iterator[Row]:
        for rows in self.by_pid.values():
            yield from rows


class KeptLines:
    """One invocation's kept lines: its head, its tail and its latest error lines."""

    __slots__ = (
        "_after_frame",
        "_matches",
        "errors",
        "head",
        "head_budget",
        "head_bytes",
        "head_lines",
        "head_open",
        "tail",
        "tail_budget",
        "tail_bytes",
        "tail_lines",
    )

    def __init__(self, caps: TrackerConfig) -> None:
        self.head: list[Row] = []
        self.tail: deque[Row] = deque()
        self.errors = _ErrorLines(caps.max_error_lines, caps.max_invocation_bytes // 2)
        self.head_lines = caps.head_lines
        self.tail_lines = caps.tail_lines
        self.head_budget = caps.max_invocation_bytes // 8  # bytes, as line_cost counts them
        self.tail_budget = caps.max_invocation_bytes * 3 // 8
        self.head_bytes = 0
        self.tail_bytes = 0
        self.head_open = True  # until a line does not fit: the head is the first lines, unbroken
        self._after_frame: set[int | None] = set()
        self._matches: dict[int, bool] = {}  # seq -> _IMPORTANT matched

    def add(self, row: Row) -> None:
        """Keep `row` in the head while it is open, else in the tail; a line leaving the tail
        stays if it is worth keeping."""
        cost = line_cost(row[1])
        if self.head_open:
            if len(self.head) < self.head_lines and self.head_bytes + cost <= self.head_budget:
                self.head.append(row)
                self.head_bytes += cost
                return
            self.head_open = False
        tail = self.tail
        tail.append(row)
        self.tail_bytes += cost
        if len(tail) > self.tail_lines:
            self._leave_tail()
        while self.tail_bytes > self.tail_budget and len(tail) > 1:
            self._leave_tail()

    def _leave_tail(self) -> None:
        row = self.tail.popleft()
        self.tail_bytes -= line_cost(row[1])
        self._keep_if_important(row)

    def _keep_if_important(self, row: Row) -> None:
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
            self.errors.add(row)
            return
        # _matches_important's cached answer, inline (this runs for nearly every line).
        matched = self._matches.pop(row[0], None)
        if matched is None:
            matched = self._matches_important(row)
        if matched:
            self.errors.add(row)

    def _matches_important(self, row: Row) -> bool:
        """`_IMPORTANT.search(row text)`, computed for the whole tail at once when needed."""
        matched = self._matches.pop(row[0], None)
        if matched is not None:
            return matched
        # `row` just left the tail; every row still in it leaves later, each exactly once.
        rows = [row, *self.tail]
        flags = _important_flags([r[1] for r in rows])
        self._matches = {r[0]: flag for r, flag in zip(rows[1:], flags[1:], strict=True)}
        return flags[0]

    def lines(self) -> tuple[LogLine, ...]:
        """Every kept line once, in the order they were added."""
        rows = sorted({r[0]: r for r in (*self.head, *self.errors.rows(), *self.tail)}.values())
        return tuple(
            LogLine(text=text, pid=pid, priority=prio, realtime_us=ts)
            for _, text, pid, prio, ts in rows
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
