"""Property-based tests: no journal content and no order of entries can break the pipeline.

Arbitrary interleavings of PID 1's lifecycle messages and service lines for several units,
hosts and boots (missing and repeated fields, unknown or repeated invocation ids, restarts logged
under either id, timestamps out of order, boots changing, journald's "Suppressed" notices), fed
to the tracker and to the whole pipeline. Asserted: nothing raises, every ended invocation is
returned exactly once, no line lands in two invocations, and every line is either in exactly one
invocation or counted as late.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_supervisor.classify.table import load_table
from vllm_supervisor.config import Config, TrackerConfig, UnitConfig
from vllm_supervisor.model import Ending, JournalEntry, LifecycleEvent
from vllm_supervisor.pipeline import Pipeline
from vllm_supervisor.track.tracker import InvocationTracker, Now

UNITS = ("vllm.service", "sglang.service")
HOSTS = (None, "a" * 32, "b" * 32)
BOOTS = (None, "1" * 32, "2" * 32)
IDS = (None, "i1", "i2", "i3", "i4")
TEXTS = (
    "INFO: Uvicorn running on http://0.0.0.0:8000",
    "Traceback (most recent call last):",
    '  File "/opt/vllm/vllm/engine.py", line 10, in run',
    "RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version (0.6.4)",
    "ValueError: bad request",
    "ERROR 11-30 10:11:04 [core.py:1] EngineCore failed to start.",
    "",
    "\x00\r\x1b[31m",
    "x" * 300,
)
FIELD_VALUES = st.one_of(st.none(), st.sampled_from(("", "0", "1", "143", "9", "-1", "x")))


@dataclass(frozen=True)
class Spec:
    """One entry to build: a service line or one of PID 1's (or journald's) messages."""

    kind: str  # "line" or a LifecycleEvent name
    unit: str
    host: str | None
    boot: str | None
    invocation_id: str | None
    pid: int | None
    text: str
    fields: tuple[tuple[str, str], ...]
    time_step: int  # microseconds after the previous entry (negative: out of order)


def _fields() -> st.SearchStrategy[tuple[tuple[str, str], ...]]:
    keys = st.sampled_from(
        (
            "EXIT_CODE",
            "EXIT_STATUS",
            "UNIT_RESULT",
            "N_RESTARTS",
            "JOB_TYPE",
            "JOB_RESULT",
            "N_DROPPED",
            "COMMAND",
            "OBJECT_SYSTEMD_INVOCATION_ID",
        )
    )
    values = st.sampled_from(
        (
            "exited",
            "killed",
            "dumped",
            "1",
            "0",
            "143",
            "start-limit-hit",
            "exit-code",
            "success",
            "exec-condition",
            "stop",
            "restart",
            "start",
            "ExecStart",
            "ExecCondition",
            "i2",
            "",
            "banana",
            "99999999999999999999",
        )
    )
    return st.lists(st.tuples(keys, values), max_size=4).map(tuple)


SPECS = st.builds(
    Spec,
    kind=st.sampled_from(("line", "line", "line", *(e.name for e in LifecycleEvent))),
    unit=st.sampled_from(UNITS),
    host=st.sampled_from(HOSTS),
    boot=st.sampled_from(BOOTS),
    invocation_id=st.sampled_from(IDS),
    pid=st.one_of(st.none(), st.integers(1, 5)),
    text=st.sampled_from(TEXTS),
    fields=_fields(),
    time_step=st.one_of(
        st.integers(0, 2_000), st.integers(0, 10_000_000), st.integers(-5_000_000, 0)
    ),
)


def _entries(specs: list[Spec]) -> tuple[list[JournalEntry], int]:
    """The entries, and how many of them are service lines (each with a unique text)."""
    clock = 1_700_000_000_000_000
    entries: list[JournalEntry] = []
    lines = 0
    for n, spec in enumerate(specs):
        clock = max(0, clock + spec.time_step)
        if spec.kind == "line":
            lines += 1
            entries.append(
                JournalEntry(
                    cursor=f"c{n}",
                    realtime_us=clock,
                    message=f"{spec.text} #{n}",
                    unit=spec.unit,
                    invocation_id=spec.invocation_id,
                    pid=spec.pid,
                    priority=6,
                    host=spec.host,
                    boot_id=spec.boot,
                )
            )
            continue
        event = LifecycleEvent[spec.kind]
        entries.append(
            JournalEntry(
                cursor=f"c{n}",
                realtime_us=clock,
                message=f"{spec.kind} #{n}",
                unit=spec.unit,
                invocation_id=spec.invocation_id,
                pid=1,
                message_id=event.value,
                from_pid1=event is not LifecycleEvent.SUPPRESSED,
                fields=dict(spec.fields),
                host=spec.host,
                boot_id=spec.boot,
            )
        )
    return entries, lines


CAPS = TrackerConfig(head_lines=3, tail_lines=3, max_error_lines=4, max_open_invocations=3)
FLUSH_EVERY = st.integers(0, 7)  # 0: never flush on the reader's clock between entries


class TestTrackerIsTotal:
    @given(specs=st.lists(SPECS, max_size=120), flush_every=FLUSH_EVERY)
    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def test_every_invocation_once_and_every_line_in_one_place(
        self, specs: list[Spec], flush_every: int
    ) -> None:
        """No order of entries raises; each invocation ends once; each line is counted once."""
        ticks = itertools.count()
        clock = lambda: float(next(ticks))  # noqa: E731
        tracker = InvocationTracker(CAPS, clock=clock)
        entries, lines = _entries(specs)
        ended = []
        for n, entry in enumerate(entries):
            ended += tracker.feed(entry)
            if flush_every and n % flush_every == 0:
                ended += tracker.due(Now(read=clock()))
            _check_running_starts(tracker)
        ended += tracker.close_all()
        assert tracker.running_starts() == {}
        named = Counter(
            (i.host, i.unit, i.invocation_id) for i in ended if i.invocation_id is not None
        )
        assert all(count == 1 for count in named.values()), named
        kept = Counter(line.text for inv in ended for line in inv.lines)
        assert all(count == 1 for count in kept.values()), kept
        assert sum(i.total_lines for i in ended) + tracker.late_lines == lines
        for inv in ended:
            assert inv.dropped_lines == inv.total_lines - len(inv.lines)
            assert inv.ending in Ending
        assert tracker.replay_from() is None
        assert tracker.close_all() == []


def _check_running_starts(tracker: InvocationTracker) -> None:
    """What /metrics reads at a scrape: a start for exactly the units with a running
    invocation, and only the start PID 1 logged (its own realtime)."""
    starts = tracker.running_starts()
    for unit, (started, _served) in starts.items():
        running = tracker.open_invocation(unit)
        assert running is not None, unit
        if started is not None:
            assert running.start_seen
            assert started == running.started_us
    for unit in UNITS:
        if unit not in starts:
            assert tracker.open_invocation(unit) is None


class TestPipelineIsTotal:
    TABLE = load_table(Config())

    @given(specs=st.lists(SPECS, max_size=80))
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def test_every_ended_invocation_is_decided_once(self, specs: list[Spec]) -> None:
        """Tracker, classifier and policy together decide each ended invocation exactly once."""
        config = Config(units=tuple(UnitConfig(name=u) for u in UNITS), tracker=CAPS)
        pipeline = Pipeline(config, self.TABLE)
        entries, _ = _entries(specs)
        ended = pipeline.feed(entries) + pipeline.due(Now(journal_us=1 << 62)) + pipeline.finish()
        outcomes = pipeline.decide_all(ended)
        assert pipeline.skipped_entries == 0
        named = Counter(
            (o.invocation.host, o.invocation.unit, o.invocation.invocation_id)
            for o in outcomes
            if o.invocation.invocation_id is not None
        )
        assert all(count == 1 for count in named.values()), named
        for outcome in outcomes:
            assert outcome.decision.reason
            assert outcome.to_json()["verdict"]["title"]
