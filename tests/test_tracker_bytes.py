"""The tracker's memory in bytes: an invocation's kept lines stay within its byte budget.

The line caps (head 200, tail 400, error lines 2000) bound an invocation by lines; lines of
16 KiB (a prompt echoed in an error, a tensor printed) made that ~43 MB per open invocation,
340 MB for 8 units. `max_invocation_bytes` bounds them together, whatever their length.
"""

from __future__ import annotations

import itertools
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_supervisor.config import TrackerConfig
from vllm_supervisor.model import Invocation, JournalEntry, LifecycleEvent
from vllm_supervisor.track.retention import line_cost
from vllm_supervisor.track.tracker import InvocationTracker, Now

UNIT = "vllm.service"
KIB = 1024
CORPUS = Path(__file__).parent / "data" / "corpus"
_cursors: Iterator[int] = itertools.count()


def line(
    text: str, *, unit: str = UNIT, inv: str = "A", pid: int = 10, priority: int = 6
) -> JournalEntry:
    n = next(_cursors)
    return JournalEntry(
        cursor=f"c{n}",
        realtime_us=n,
        message=text,
        unit=unit,
        invocation_id=inv,
        pid=pid,
        priority=priority,
    )


def end(inv: str = "A", unit: str = UNIT) -> list[JournalEntry]:
    """PID 1's exit and failure of the invocation."""
    entries = []
    for kind, fields in (
        (LifecycleEvent.PROCESS_EXITED, {"EXIT_CODE": "exited", "EXIT_STATUS": "1"}),
        (LifecycleEvent.UNIT_FAILED, {"UNIT_RESULT": "exit-code"}),
    ):
        n = next(_cursors)
        entries.append(
            JournalEntry(
                cursor=f"c{n}",
                realtime_us=n,
                message=kind.name,
                unit=unit,
                invocation_id=inv,
                pid=1,
                from_pid1=True,
                message_id=kind.value,
                fields=fields,
            )
        )
    return entries


def run(tracker: InvocationTracker, entries: list[JournalEntry]) -> list[Invocation]:
    ended: list[Invocation] = []
    for entry in entries:
        ended += tracker.feed(entry)
    return ended + tracker.due(Now(journal_us=1 << 62))


def kept_bytes(invocation: Invocation) -> int:
    """What the tracker counts for the lines it kept (their text as stored, and their rows)."""
    return sum(line_cost(x.text) for x in invocation.lines)


def error_line(n: int, size: int) -> str:
    head = f"RuntimeError: request {n} failed: "
    return head + "x" * (size - len(head))


class TestByteBudget:
    def test_16_kib_error_lines_are_kept_within_the_budget(self) -> None:
        """2,700 error lines of 16 KiB: the invocation keeps at most its budget of them."""
        caps = TrackerConfig()
        lines = [line(error_line(n, 16 * KIB), priority=3) for n in range(2700)]
        (crash,) = run(InvocationTracker(caps), [*lines, *end()])
        assert kept_bytes(crash) <= caps.max_invocation_bytes
        assert crash.total_lines == 2700
        assert crash.dropped_lines == 2700 - len(crash.lines)
        texts = [x.text for x in crash.lines]
        assert texts[0] == error_line(0, 16 * KIB)  # the head
        assert texts[-1] == error_line(2699, 16 * KIB)  # the tail

    def test_the_traceback_after_a_flood_of_long_lines_survives(self) -> None:
        """The short traceback that ends a run of long lines is kept whole."""
        flood = [line(error_line(n, 16 * KIB), priority=3) for n in range(3000)]
        traceback = [
            "Traceback (most recent call last):",
            '  File "/opt/vllm/engine.py", line 12, in step',
            "    self.model.forward(batch)",
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        ]
        (crash,) = run(InvocationTracker(), [*flood, *(line(t) for t in traceback), *end()])
        texts = [x.text for x in crash.lines]
        assert texts[-4:] == traceback

    def test_another_process_keeps_its_error_lines_when_one_floods(self) -> None:
        """A process flooding long error lines cannot push out another's short ones."""
        quiet = [line(f"ERROR worker {n} lost its peer", pid=20) for n in range(5)]
        flood = [line(error_line(n, 16 * KIB), pid=30, priority=3) for n in range(3000)]
        noise = [line(f"INFO request {n}") for n in range(1000)]  # pushes both out of the tail
        caps = TrackerConfig(head_lines=1)
        (crash,) = run(InvocationTracker(caps), [line("start"), *quiet, *flood, *noise, *end()])
        texts = {x.text for x in crash.lines}
        assert all(q.message in texts for q in quiet)

    @pytest.mark.parametrize("end", ["", "…[cut]"], ids=["ascii", "cut"])
    def test_eight_open_invocations_of_long_lines_hold_eight_budgets(self, end: str) -> None:
        """What the tracker allocates for 8 units logging 16 KiB error lines, runs still open,
        is about 8 budgets (before: 2,600 lines each, ~43 MB per unit); also for lines the
        parser cut, whose "…" makes the interpreter store 2 bytes a character."""
        caps = TrackerConfig()
        tracker = InvocationTracker(caps)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for n in range(2700):
                for unit in range(8):  # a string of its own for each, as each entry has
                    text = error_line(n, 16 * KIB) + end
                    tracker.feed(line(text, unit=f"serve-{unit}.service", priority=3))
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert held <= 8 * caps.max_invocation_bytes * 1.25, held

    def test_an_open_run_of_long_lines_holds_half_a_megabyte_by_default(self) -> None:
        """The worst case of one unit with the default caps: a run still open, every line a
        16 KiB error line, holds at most ~0.5 MB (before: 1 MiB budgets, ~1.1 MB)."""
        tracker = InvocationTracker(TrackerConfig())
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for n in range(2700):
                tracker.feed(line(error_line(n, 16 * KIB), priority=3))
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert held <= 0.55e6, held

    def test_eight_ranks_longest_real_tracebacks_survive_a_flood_by_default(self) -> None:
        """The longest traceback of the corpus (a real vLLM 0.33 run), printed by 8 ranks at
        once after another process flooded 16 KiB error lines: the default budget keeps every
        rank's traceback whole, down to its exception line."""
        log = CORPUS / "212-real-vllm-corrupt-safetensors.log"
        lines = log.read_text(encoding="utf-8").splitlines()
        start = max(i for i, text in enumerate(lines) if text.startswith("Traceback"))
        traceback = lines[start:]
        assert len(traceback) >= 50
        flood = [line(error_line(n, 16 * KIB), pid=30, priority=3) for n in range(2700)]
        ranks = [
            line(f"(Worker_TP{rank} pid={40 + rank}) {text}", pid=40 + rank)
            for text in traceback
            for rank in range(8)
        ]
        (crash,) = run(InvocationTracker(TrackerConfig()), [*flood, *ranks, *end()])
        kept = [x.text for x in crash.lines]
        for rank in range(8):
            mine = [t for t in kept if t.startswith(f"(Worker_TP{rank} ")]
            assert mine == [f"(Worker_TP{rank} pid={40 + rank}) {text}" for text in traceback]

    def test_lines_within_the_caps_are_all_kept(self) -> None:
        """An ordinary crash (short lines, under every cap) keeps every line: the budget only
        binds on long lines."""
        lines = [line(f"INFO line {n}") for n in range(500)]
        (crash,) = run(InvocationTracker(), [*lines, *end()])
        assert len(crash.lines) == 500


SIZES = st.integers(0, 5000)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lines=st.lists(
        st.tuples(SIZES, st.sampled_from([3, 6]), st.integers(1, 4)), min_size=1, max_size=300
    ),
    budget=st.integers(1, 64 * KIB),
)
def test_kept_lines_never_exceed_the_budget_and_the_last_line_stays(
    lines: list[tuple[int, int, int]], budget: int
) -> None:
    """Any lengths, priorities and processes: the kept lines cost at most the budget (plus
    the newest line, always kept), every count cap holds, and each line is kept at most once."""
    caps = TrackerConfig(
        head_lines=5, tail_lines=10, max_error_lines=20, max_invocation_bytes=budget
    )
    entries = [
        line(f"{n}:" + "e" * size, priority=priority, pid=pid)
        for n, (size, priority, pid) in enumerate(lines)
    ]
    (crash,) = run(InvocationTracker(caps), [*entries, *end()])
    newest = line_cost(entries[-1].message)
    assert kept_bytes(crash) <= budget + newest
    assert len(crash.lines) <= 5 + 10 + 20
    assert crash.lines[-1].text == entries[-1].message
    texts = [x.text for x in crash.lines]
    assert len(texts) == len(set(texts))
    assert crash.dropped_lines == len(entries) - len(crash.lines)
