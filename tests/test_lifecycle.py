"""The invocation tracker: grouping by invocation id, ends by MESSAGE_ID, bounded memory."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from vllm_supervisor.config import TrackerConfig
from vllm_supervisor.model import Ending, Invocation, JournalEntry, LifecycleEvent
from vllm_supervisor.track.tracker import InvocationTracker, Now

UNIT = "vllm.service"
_cursors: Iterator[int] = itertools.count()


def line(
    text: str, inv: str = "A", pid: int = 10, unit: str = UNIT, at_us: int | None = None
) -> JournalEntry:
    n = next(_cursors)
    return JournalEntry(
        cursor=f"c{n}",
        realtime_us=n if at_us is None else at_us,
        message=text,
        unit=unit,
        invocation_id=inv,
        pid=pid,
    )


def event(
    kind: LifecycleEvent, inv: str = "A", unit: str = UNIT, at_us: int | None = None, **fields: str
) -> JournalEntry:
    n = next(_cursors)
    return JournalEntry(
        cursor=f"c{n}",
        realtime_us=n if at_us is None else at_us,
        message=kind.name,
        unit=unit,
        invocation_id=inv,
        pid=1,
        from_pid1=True,
        message_id=kind.value,
        fields=fields,
    )


def feed_all(tracker: InvocationTracker, entries: list[JournalEntry]) -> list[Invocation]:
    """Feed everything, then let every late-line window pass."""
    ended: list[Invocation] = []
    for entry in entries:
        ended += tracker.feed(entry)
    return ended + tracker.due(Now(journal_us=1 << 62))


EXITED = event(LifecycleEvent.PROCESS_EXITED, EXIT_CODE="exited", EXIT_STATUS="1")
FAILED = event(LifecycleEvent.UNIT_FAILED, UNIT_RESULT="exit-code")


class TestEnds:
    """When an invocation ends and what it records."""

    def test_crash_ends_on_failed_result(self) -> None:
        """Exit code and status come from 'Main process exited', the result from 'Failed'."""
        ended = feed_all(InvocationTracker(), [line("a"), line("b"), EXITED, FAILED])
        assert len(ended) == 1
        inv = ended[0]
        assert (inv.exit_code, inv.exit_status, inv.result) == ("exited", 1, "exit-code")
        assert [x.text for x in inv.lines] == ["a", "b"]
        assert inv.failed

    def test_clean_exit_ends_on_deactivated(self) -> None:
        """'Deactivated successfully' ends an invocation that did not fail."""
        ended = feed_all(
            InvocationTracker(),
            [
                line("serving"),
                event(LifecycleEvent.PROCESS_EXITED, EXIT_CODE="exited", EXIT_STATUS="0"),
                event(LifecycleEvent.DEACTIVATED),
            ],
        )
        assert [(i.result, i.failed) for i in ended] == [("success", False)]

    def test_new_invocation_id_closes_the_previous_one(self) -> None:
        """A start whose predecessor's end was never logged still separates the two."""
        ended = feed_all(InvocationTracker(), [line("a", inv="A"), line("b", inv="B")])
        assert [i.invocation_id for i in ended] == ["A"]

    def test_skipped_start_is_marked(self) -> None:
        """A start skipped by ExecCondition is recorded as such, not as a crash."""
        ended = feed_all(
            InvocationTracker(),
            [event(LifecycleEvent.CONDITION_SKIPPED, UNIT_RESULT="exec-condition")],
        )
        assert [(i.result, i.ending, i.failed) for i in ended] == [
            ("exec-condition", Ending.SKIPPED, False)
        ]

    def test_restart_counter_is_carried_to_the_next_invocation(self) -> None:
        """The invocation after 'restart counter is at 3' knows it is the third restart."""
        ended = feed_all(
            InvocationTracker(),
            [
                line("x", inv="A"),
                EXITED,
                FAILED,
                event(LifecycleEvent.RESTART_SCHEDULED, N_RESTARTS="3"),
                line("y", inv="B"),
                event(LifecycleEvent.UNIT_FAILED, inv="B", UNIT_RESULT="exit-code"),
            ],
        )
        assert [i.restarts for i in ended] == [0, 3]

    def test_suppressed_lines_are_counted(self) -> None:
        """journald's rate-limit message adds to the invocation's suppressed count."""
        suppressed = JournalEntry(
            cursor="s",
            realtime_us=1,
            message="Suppressed 120 messages from vllm.service",
            unit=UNIT,
            message_id=LifecycleEvent.SUPPRESSED.value,
            fields={"N_DROPPED": "120"},
        )
        ended = feed_all(InvocationTracker(), [line("a"), suppressed, EXITED, FAILED])
        assert ended[0].suppressed_lines == 120

    def test_units_are_tracked_apart(self) -> None:
        """Two units' interleaved lines never mix."""
        ended = feed_all(
            InvocationTracker(),
            [
                line("v", unit="vllm.service"),
                line("s", unit="sglang.service", inv="S"),
                event(LifecycleEvent.UNIT_FAILED, unit="sglang.service", inv="S"),
            ],
        )
        assert [(i.unit, [x.text for x in i.lines]) for i in ended] == [("sglang.service", ["s"])]


class TestMemory:
    """Bounded memory: head, tail and the lines that matter."""

    def test_long_invocation_keeps_head_tail_and_errors(self) -> None:
        """Only head and tail of the noise are kept; the traceback in the middle survives."""
        caps = TrackerConfig(head_lines=3, tail_lines=3, max_error_lines=10)
        noise = [line(f"request {n}") for n in range(1000)]
        crash = [
            line("Traceback (most recent call last):"),
            line('  File "x.py", line 1, in f'),
            line("    do_it()"),
            line("RuntimeError: boom"),
        ]
        more = [line(f"request {n}") for n in range(1000, 2000)]
        ended = feed_all(InvocationTracker(caps), [*noise, *crash, *more, EXITED, FAILED])
        texts = [x.text for x in ended[0].lines]
        assert texts[:3] == ["request 0", "request 1", "request 2"]
        assert texts[-3:] == ["request 1997", "request 1998", "request 1999"]
        for kept in ("Traceback (most recent call last):", "    do_it()", "RuntimeError: boom"):
            assert kept in texts
        assert ended[0].total_lines == 2004
        assert ended[0].dropped_lines == 2004 - len(texts)

    @pytest.mark.parametrize("errors", [5, 50])
    def test_error_lines_are_capped(self, errors: int) -> None:
        """A storm of error lines cannot grow an invocation past its cap."""
        caps = TrackerConfig(head_lines=1, tail_lines=1, max_error_lines=4)
        entries = [line(f"ERROR {n}") for n in range(errors)]
        ended = feed_all(InvocationTracker(caps), [*entries, line("end"), EXITED, FAILED])
        assert len(ended[0].lines) <= 1 + 1 + 4


class TestReplay:
    """Where a restarted daemon must start reading again."""

    def test_replay_from_is_the_first_line_of_the_open_invocation(self) -> None:
        """An open invocation must be re-read from its first entry after a restart."""
        tracker = InvocationTracker()
        first = line("a", inv="Z")
        feed_all(tracker, [first, line("b", inv="Z")])
        assert tracker.replay_from() == first.cursor
        feed_all(tracker, [event(LifecycleEvent.UNIT_FAILED, inv="Z")])
        assert tracker.replay_from() is None


def test_a_line_without_invocation_id_does_not_anonymise_the_invocation() -> None:
    """An invocation whose first line lacks the id takes it from the next entry that has it."""
    first = JournalEntry(cursor="x0", realtime_us=0, message="banner", unit=UNIT, pid=3)
    ended = feed_all(
        InvocationTracker(), [first, line("b", inv="Q"), event(LifecycleEvent.UNIT_FAILED, inv="Q")]
    )
    assert [(i.invocation_id, len(i.lines)) for i in ended] == [("Q", 2)]


def kill_request(signal: str, inv: str = "A", at_us: int | None = None) -> JournalEntry:
    """PID 1's line for `systemctl kill` (it has no MESSAGE_ID), as systemd 252 writes it."""
    n = next(_cursors)
    return JournalEntry(
        cursor=f"c{n}",
        realtime_us=n if at_us is None else at_us,
        message=f"{UNIT}: Sent signal {signal} to main process 85 (python3) on client request.",
        unit=UNIT,
        invocation_id=inv,
        pid=1,
        from_pid1=True,
    )


class TestKillRequests:
    """`systemctl kill -s KILL U`, 3 times 10 s after each start, was 3 unknown crashes and a
    halt on the 3rd. A person's (or a tool's) kill is no crash."""

    def killed(self, signal: str, kill_at_us: int) -> Invocation:
        tracker = InvocationTracker(TrackerConfig(settle_s=0))
        tracker.feed(line("INFO serving", at_us=1_000_000))
        tracker.feed(kill_request(signal, at_us=kill_at_us))
        tracker.feed(
            event(LifecycleEvent.PROCESS_EXITED, at_us=100_000_000, EXIT_CODE="killed",
                  EXIT_STATUS="9")
        )  # fmt: skip
        (inv,) = tracker.feed(
            event(LifecycleEvent.UNIT_FAILED, at_us=100_000_001, UNIT_RESULT="signal")
        )
        return inv

    def test_a_kill_request_ends_it_as_a_stop(self) -> None:
        assert self.killed("SIGKILL", kill_at_us=99_000_000).ending is Ending.STOPPED
        assert self.killed("SIGTERM", kill_at_us=99_000_000).ending is Ending.STOPPED

    def test_a_signal_that_does_not_end_a_process_is_no_stop(self) -> None:
        assert self.killed("SIGHUP", kill_at_us=99_000_000).ending is Ending.EXITED

    def test_a_kill_request_long_before_the_end_is_no_stop(self) -> None:
        assert self.killed("SIGTERM", kill_at_us=2_000_000).ending is Ending.EXITED


class TestLateLines:
    """journald's stdout stream can lag behind PID 1's message that the unit failed."""

    def test_late_lines_join_the_ended_invocation(self) -> None:
        """Lines arriving after 'Failed' but within the settle window belong to the crash."""
        tracker = InvocationTracker(TrackerConfig(settle_s=1.0))
        failed = event(LifecycleEvent.UNIT_FAILED, UNIT_RESULT="exit-code")
        late = line("RuntimeError: the real cause")
        assert tracker.feed(line("a")) == []
        assert tracker.feed(failed) == []
        assert tracker.feed(late) == []
        (inv,) = tracker.due(Now(journal_us=late.realtime_us + 1_000_000))
        assert [x.text for x in inv.lines] == ["a", "RuntimeError: the real cause"]

    def test_next_start_cuts_the_wait_for_late_lines(self) -> None:
        """A new invocation of the unit shortens the wait for the previous one's late lines to
        settle_after_start_s (its processes are gone; the new start's gate is waiting)."""
        tracker = InvocationTracker(TrackerConfig(settle_s=60.0, settle_after_start_s=0.1))
        tracker.feed(line("a", inv="A", pid=10, at_us=1_000_000))
        tracker.feed(event(LifecycleEvent.UNIT_FAILED, inv="A", at_us=1_000_001))
        assert tracker.feed(line("b", inv="B", pid=20, at_us=1_000_002)) == []
        assert tracker.feed(line("c", inv="B", pid=20, at_us=1_050_000)) == []
        ended = tracker.feed(line("d", inv="B", pid=20, at_us=1_200_000))
        assert [i.invocation_id for i in ended] == ["A"]

    def test_a_flood_still_being_written_holds_the_decision(self) -> None:
        """journald writes a dead process's flood for seconds after PID 1's "Failed": each of
        its lines keeps the window open, so the cause printed last is in, up to drain_max_s
        after the end (seen on systemd 252: 120,000 lines, the cause 4 s after the exit)."""
        tracker = InvocationTracker(TrackerConfig(settle_s=0.3, drain_max_s=10.0))
        tracker.feed(line("flood 0", at_us=1_000_000))
        tracker.feed(event(LifecycleEvent.UNIT_FAILED, at_us=1_100_000))
        for n in range(1, 40):  # one line every 0.1 s, for 4 s after the end
            assert tracker.feed(line(f"flood {n}", at_us=1_100_000 + n * 100_000)) == []
        assert tracker.feed(line("RuntimeError: the cause", at_us=5_100_000)) == []
        (inv,) = tracker.due(Now(journal_us=5_500_000))
        assert inv.lines[-1].text == "RuntimeError: the cause"

    def test_the_wait_for_a_flood_is_bounded(self) -> None:
        tracker = InvocationTracker(TrackerConfig(settle_s=0.3, drain_max_s=2.0))
        tracker.feed(event(LifecycleEvent.UNIT_FAILED, at_us=1_000_000))
        ended: list[Invocation] = []
        for n in range(1, 40):
            ended += tracker.feed(line(f"flood {n}", at_us=1_000_000 + n * 100_000))
        assert [i.invocation_id for i in ended] == ["A"]
        assert ended[0].total_lines < 25  # decided 2 s after its end, not after the flood

    def test_late_lines_stamped_with_the_held_restart_are_the_ended_runs(self) -> None:
        """journald stamps a line with the id it reads from the unit's cgroup when it writes
        it: a dead run's lines written after the restart began carry the new run's id, from
        its processes and from new ones. The new run's gate holds its main process until the
        ended run is decided: until PID 1 says it started, its processes' lines are its own."""
        tracker = InvocationTracker(TrackerConfig(settle_s=0.3, settle_after_start_s=0.1))
        tracker.feed(line("flood", inv="A", pid=10, at_us=1_000_000))
        tracker.feed(event(LifecycleEvent.UNIT_FAILED, inv="A", at_us=1_100_000))
        tracker.feed(event(LifecycleEvent.STARTING, inv="B", at_us=1_200_000, JOB_TYPE="start"))
        assert tracker.feed(line("flood", inv="B", pid=10, at_us=1_250_000)) == []
        assert tracker.feed(line("RuntimeError: cause", inv="B", pid=10, at_us=1_300_000)) == []
        # A process the ended run never had is not taken for one of its own.
        assert tracker.feed(line("INFO gate", inv="B", pid=11, at_us=1_310_000)) == []
        (a,) = tracker.due(Now(journal_us=1_700_000))
        assert (a.invocation_id, [x.text for x in a.lines][-1]) == ("A", "RuntimeError: cause")
        # Once PID 1 says B's main process started, B's lines are its own.
        tracker.feed(event(LifecycleEvent.JOB_STARTED, inv="B", at_us=1_800_000))
        tracker.feed(line("INFO serving", inv="B", pid=20, at_us=1_900_000))
        tracker.feed(event(LifecycleEvent.UNIT_FAILED, inv="B", at_us=2_000_000))
        (b,) = tracker.due(Now(journal_us=3_000_000))
        assert [x.text for x in b.lines] == ["INFO gate", "INFO serving"]

    def test_zero_settle_decides_on_the_failed_message(self) -> None:
        """With no settle window the invocation ends on PID 1's message itself."""
        tracker = InvocationTracker(TrackerConfig(settle_s=0))
        tracker.feed(line("a"))
        assert len(tracker.feed(event(LifecycleEvent.UNIT_FAILED))) == 1


def test_a_run_closed_as_hung_takes_nothing_more() -> None:
    """The hang watcher keeps no list of its own: once closed as hung, the run's late line and
    PID 1's messages about its end are dropped by the tracker, never a second end."""
    tracker = InvocationTracker(TrackerConfig(settle_s=0))
    tracker.feed(line("EngineDeadError", inv="H"))
    closed = tracker.close(UNIT, None, "H", Ending.HUNG)
    assert closed is not None and closed.ending is Ending.HUNG
    after = [
        line("INFO shutting down", inv="H"),
        event(LifecycleEvent.PROCESS_EXITED, inv="H", EXIT_CODE="exited", EXIT_STATUS="1"),
        event(LifecycleEvent.UNIT_FAILED, inv="H", UNIT_RESULT="exit-code"),
        event(LifecycleEvent.JOB_STOPPED, inv="H", JOB_TYPE="stop"),
    ]
    assert feed_all(tracker, after) == []
    assert tracker.late_lines == 1
