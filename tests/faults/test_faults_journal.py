"""Faults of the journal itself: rotation and vacuum under the follower, hostile entries."""

from __future__ import annotations

import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from conftest import wait_for

from faults.conftest import SupervisorFactory
from faults.harness import (
    UNIT,
    Supervisor,
    classified,
    crash,
    db_rows,
    history_cli,
    last_cursor,
    saved_cursor,
)
from vllm_supervisor.journal.writer import FieldValue, JournalWriter, service_lines, vacuum_files

KIND_OF = {1: "fatal", 2: "transient", 3: "unknown", 4: "fatal", 5: "transient", 6: "unknown"}
GAPS = "vllm_supervisor_journal_cursor_gaps_total"


def _ids(serials: list[int]) -> list[str]:
    return [f"{n:032x}" for n in serials]


def _metric(sup: Supervisor, name: str) -> float:
    """A series of the latest run's /metrics (loopback, the port it logged)."""
    port = [e["port"] for e in sup.events() if e["event"] == "metrics_listening"][-1]
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    values = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, f"{name} not exported"
    return float(values[0])


def _events(sup: Supervisor, name: str) -> list[dict[str, object]]:
    return [e for e in sup.events() if e["event"] == name]


def _wait_classified(state: Path, writer: JournalWriter, count: int) -> None:
    def enough() -> bool:
        writer.nudge()
        return len(classified(state)) >= count

    wait_for(enough, what=f"{count} crashes classified")


def _assert_history(state: Path, serials: list[int]) -> None:
    """Each crash once, in journal order, with the severity its lines call for."""
    history = history_cli(state)
    got = [item["invocation_id"] for item in history]
    assert Counter(got).most_common(1)[0][1] == 1, f"a crash was recorded twice: {got}"
    assert _ids(serials) == got
    severities = [item["verdict"]["severity"] for item in history]
    assert [KIND_OF[n] for n in serials] == severities


class TestRotationWhileFollowing:
    """journal files rotated and vacuumed under a running daemon."""

    def test_rotation_and_vacuum_lose_and_repeat_nothing(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """Two rotations (one inside a crash), two vacuums: every crash once, the same reader."""
        sup = make_supervisor()
        state, journal = tmp_path / "state", tmp_path / "journal"
        with JournalWriter(journal) as writer:
            writer.write(crash(KIND_OF[1], 1))
            sup.start()
            _wait_classified(state, writer, 1)
            # Crash 2 starts in one file and ends in the next one.
            second = crash(KIND_OF[2], 2)
            writer.write(second[:3])
            first = writer.rotate()
            writer.write(second[3:])
            writer.write(crash(KIND_OF[3], 3))
            _wait_classified(state, writer, 3)
            # Old files go while the follower has them open.
            assert [first.name] == vacuum_files(journal, keep_files=1)
            writer.write(crash(KIND_OF[4], 4))
            _wait_classified(state, writer, 4)
            second_file = writer.rotate()
            writer.write(crash(KIND_OF[5], 5))
            _wait_classified(state, writer, 5)
            assert [second_file.name] == vacuum_files(journal, keep_files=1)
            writer.write(crash(KIND_OF[6], 6))
            _wait_classified(state, writer, 6)
            assert [p.name for p in journal.iterdir()] == ["remote.journal"]
            assert _metric(sup, GAPS) == 0
        assert sup.terminate() == 0, sup.stderr_text()
        _assert_history(state, [1, 2, 3, 4, 5, 6])
        assert saved_cursor(state) == last_cursor(journal)
        # Following went on in place: the journalctl child never had to be restarted.
        assert _events(sup, "journal_reader_restarting") == []
        assert _events(sup, "journal_cursor_gap") == []


class TestVacuumedCursor:
    """The file holding the saved cursor is vacuumed while the daemon is stopped."""

    @pytest.mark.parametrize("stopped", ["between_invocations", "inside_an_invocation"])
    def test_resumes_after_the_vacuumed_cursor_with_a_warning_and_a_count(
        self, tmp_path: Path, make_supervisor: SupervisorFactory, stopped: str
    ) -> None:
        """A gap warning, the counter at 1, and every crash written after the vacuum classified.

        Stopped inside an invocation, the checkpoint's replay point is vacuumed too: the
        invocation's surviving lines (the NCCL watchdog, its end) still classify it.
        """
        sup = make_supervisor()
        state, journal = tmp_path / "state", tmp_path / "journal"
        third = crash(KIND_OF[2], 3)
        with JournalWriter(journal) as writer:
            writer.write(crash(KIND_OF[1], 1))
            writer.write(crash(KIND_OF[2], 2))
            head: list[dict[str, FieldValue]] = []
            if stopped == "inside_an_invocation":
                head, third = third[:3], third[3:]  # its start and first line, then the rest
                writer.write(head)
            sup.start()
            _wait_classified(state, writer, 2)
            if head:
                wait_for(lambda: saved_cursor(state) == last_cursor(journal), what="checkpoint")
            assert sup.terminate() == 0, sup.stderr_text()
            # Resuming starts at the open invocation's first entry (its "Starting"), if any.
            replay = db_rows(state, "SELECT value FROM meta WHERE key = 'replay'")
            cursor = replay[0][0] if replay else saved_cursor(state)
            writer.rotate()
            writer.write(third)
            assert len(vacuum_files(journal, keep_files=1)) == 1
            sup.start()
            wait_for(lambda: _events(sup, "journal_cursor_gap"), what="the gap warning")
            writer.write(crash(KIND_OF[4], 4))
            _wait_classified(state, writer, 4)
            assert _metric(sup, GAPS) == 1
            # The entries after the last decision (its restart scheduled) commit with the
            # next quiet checkpoint: wait for it rather than race the stop against the read.
            wait_for(lambda: saved_cursor(state) == last_cursor(journal), what="checkpoint")
        assert sup.terminate() == 0, sup.stderr_text()
        history = history_cli(state)
        assert _ids([1, 2, 3, 4]) == [h["invocation_id"] for h in history]
        assert [h["verdict"]["severity"] for h in history] == [
            "fatal",
            "transient",
            "transient",
            "fatal",
        ]
        (gap,) = _events(sup, "journal_cursor_gap")
        assert gap["level"] == "warning"
        assert cursor == gap["cursor"]
        assert "vacuumed" in str(gap["error"])
        assert saved_cursor(state) == last_cursor(journal)

    def test_cursor_in_a_rotated_file_that_was_kept_is_no_gap(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """Rotation alone keeps the saved entry (a renamed file, same cursor): no warning."""
        sup = make_supervisor()
        state, journal = tmp_path / "state", tmp_path / "journal"
        with JournalWriter(journal) as writer:
            writer.write(crash(KIND_OF[1], 1))
            sup.start()
            _wait_classified(state, writer, 1)
            assert sup.terminate() == 0, sup.stderr_text()
            writer.rotate()
            writer.write(crash(KIND_OF[2], 2))
            sup.start()
            _wait_classified(state, writer, 2)
            assert _metric(sup, GAPS) == 0
        assert sup.terminate() == 0, sup.stderr_text()
        _assert_history(state, [1, 2])
        assert _events(sup, "journal_cursor_gap") == []


Entry = dict[str, FieldValue]


def _own_line(**change: FieldValue | None) -> Entry:
    """A line of the unit's own stdout with fields replaced (or, given None, removed)."""
    (entry,) = service_lines(UNIT, "0" * 32, ["a line"])
    for key, value in change.items():
        if value is None:
            entry.pop(key)
        else:
            entry[key] = value
    return entry


# Hostile entries, each put inside its own crashed invocation; `own` says whether the entry is
# the unit's own line (so the invocation holds one more line) or not ours at all.
HOSTILE: list[tuple[str, Entry, bool]] = [
    ("no_message", _own_line(MESSAGE=None), True),
    # journald misses the id on a line printed as the process exits: still this invocation's.
    ("no_invocation_id", _own_line(_SYSTEMD_INVOCATION_ID=None), True),
    ("no_pid", _own_line(_PID=None), True),
    # Only the trusted fields: a kernel or foreign entry, not ours and not an error.
    ("no_fields_at_all", {}, False),
    ("non_utf8", _own_line(MESSAGE=b"weights \xff\xfe\xc3\x28 loaded"), True),
    ("binary", _own_line(MESSAGE=bytes(range(256))), True),
    ("one_megabyte", _own_line(MESSAGE="x" * (1 << 20)), True),
    ("nul_bytes", _own_line(MESSAGE=b"before\x00after\x00"), True),
    ("only_carriage_returns", _own_line(MESSAGE=b"\r\r\r\r"), True),
]


def _with(entries: list[Entry], hostile: Entry, serial: int) -> list[Entry]:
    """The entries with `hostile` (given their id and unit if it is their own) after the start."""
    hostile = dict(hostile)
    if "_SYSTEMD_INVOCATION_ID" in hostile:
        hostile["_SYSTEMD_INVOCATION_ID"] = f"{serial:032x}"
    if "_PID" in hostile:
        hostile["_PID"] = 4000 + serial  # printed by the invocation's own server process
    if hostile.get("_SYSTEMD_UNIT") is None and "MESSAGE" in hostile:
        hostile["_SYSTEMD_UNIT"] = UNIT
    return [entries[0], hostile, *entries[1:]]


def _error_events(sup: Supervisor) -> list[dict[str, object]]:
    return [e for e in sup.events() if e.get("level") in ("error", "critical")]


class TestHostileEntries:
    """Malformed, binary and oversized entries in the middle of real crashes."""

    def test_hostile_entries_never_cost_a_crash(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """Each crash holding a hostile entry is classified as without it; nothing is lost."""
        sup = make_supervisor()
        state, journal = tmp_path / "state", tmp_path / "journal"
        kinds = ["fatal", "transient", "unknown"]
        expected = []
        with JournalWriter(journal) as writer:
            for serial, (_name, hostile, own) in enumerate(HOSTILE, 1):
                kind = kinds[serial % 3]
                entries = crash(kind, serial)
                writer.write(_with(entries, hostile, serial))
                lines = sum(1 for e in entries if e.get("_SYSTEMD_UNIT") == UNIT)
                expected.append((f"{serial:032x}", kind, lines + own))
            writer.write(crash("fatal", 99))  # and after all of them, a plain crash
            plain = crash("fatal", 99)
            expected.append((f"{99:032x}", "fatal", sum(1 for e in plain if "MESSAGE_ID" not in e)))
            sup.start()
            _wait_classified(state, writer, len(expected))
            assert sup.alive()
        assert sup.terminate() == 0, sup.stderr_text()
        history = history_cli(state)
        got = [(h["invocation_id"], h["verdict"]["severity"], h["lines"]) for h in history]
        assert expected == got, [name for name, *_ in HOSTILE]
        fatal = [h["verdict"]["signature"] for h in history if h["verdict"]["severity"] == "fatal"]
        assert set(fatal) == {"flashinfer_cubin_mismatch"}
        assert saved_cursor(state) == last_cursor(journal)
        assert _error_events(sup) == []
        assert "Traceback" not in sup.stderr_text()


# Root-cause lines built against the Python regexes that run on every line and root cause
# (the signatures are RE2, linear by construction): each took 0.2-18 s before they were fixed.
BACKTRACKING = [
    "ValueError: " + "1" * 16000 + "x",  # the size mask: a digit run without a unit after it
    "ValueError: " + "A." * 8000 + "!",  # the URL mask: a long run of scheme characters
    "ValueError: pid" + " " * 16000 + "x",  # the pid/rank mask: spaces between two \\s*
    "ValueError: " + "a" * 16000 + "!",  # the textbook (a+)+$ victim, for the RE2 signatures
]


class TestBacktracking:
    """Lines built to make a backtracking regex engine take exponential or quadratic time."""

    def test_crafted_root_causes_classify_fast(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """Each crafted crash is classified (by no signature) in under 0.25 s, by the daemon's
        metric."""
        sup = make_supervisor()
        state, journal = tmp_path / "state", tmp_path / "journal"
        with JournalWriter(journal) as writer:
            for serial, cause in enumerate(BACKTRACKING, 1):
                entries = crash("unknown", serial)
                last_line = max(i for i, e in enumerate(entries) if "MESSAGE_ID" not in e)
                entries[last_line]["MESSAGE"] = f"(EngineCore_DP0 pid=6200) {cause}"
                # Ray's dedup suffix after a run of spaces, for logline's cleaning.
                spaces = "\x1b[0m" + " " * 16000 + "x [repeated 2x across cluster]!"
                writer.write(_with(entries, _own_line(MESSAGE=spaces), serial))
            writer.write(crash("fatal", 99))
            sup.start()
            _wait_classified(state, writer, len(BACKTRACKING) + 1)
            count = _metric(sup, "vllm_supervisor_classify_duration_seconds_count")
            fast = _metric(sup, 'vllm_supervisor_classify_duration_seconds_bucket{le="0.25"}')
            total = _metric(sup, "vllm_supervisor_classify_duration_seconds_sum")
        assert sup.terminate() == 0, sup.stderr_text()
        assert (count, fast) == (len(BACKTRACKING) + 1, count), f"{total:.2f} s in all"
        history = history_cli(state)
        causes = [h["verdict"]["root_cause"] for h in history[:-1]]
        assert [c[:40] for c in BACKTRACKING] == [c[:40] for c in causes]
        assert {None} == {h["verdict"]["signature"] for h in history[:-1]}
        assert history[-1]["verdict"]["signature"] == "flashinfer_cubin_mismatch"
        assert _error_events(sup) == []
