"""The journal reader against real journal files written by systemd-journal-remote.

Every test of real journals runs with both children: `journalctl` and the libsystemd reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
from pathlib import Path

import pytest
import structlog.testing
from conftest import poll

from vllm_supervisor.errors import JournalError
from vllm_supervisor.journal.export import CUT_MARKER
from vllm_supervisor.journal.reader import (
    NATIVE_READER,
    JournalctlReader,
    ReaderSettings,
    catch_up_argv,
    journalctl_argv,
    native_argv,
    native_input,
    read_all,
    reader_argv,
    resolve_source,
)
from vllm_supervisor.journal.writer import JournalWriter, crashed_invocation, service_lines

UNIT = "vllm.service"


@pytest.fixture(name="source", params=["journalctl", "native"])
def _source(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _lines(prefix: str, count: int) -> list[str]:
    return [f"{prefix} {n}" for n in range(count)]


async def _collect(
    reader: JournalctlReader, stop: asyncio.Event, want: int, got: list[str]
) -> None:
    async for batch in reader.batches(stop):
        got += [e.message for e in batch]
        if len(got) >= want:
            stop.set()


class TestCommandLine:
    """The journalctl arguments for each start position."""

    def test_resume_uses_the_inclusive_cursor(self) -> None:
        """--after-cursor with -u skipped a line before systemd PR #30336: use --cursor."""
        argv = journalctl_argv(ReaderSettings(units=(UNIT,)), "s=1;i=2")
        assert "--cursor=s=1;i=2" in argv
        assert not any(a.startswith("--after-cursor") for a in argv)

    def test_units_are_matched_in_python_when_following(self) -> None:
        """--unit --follow on systemd 252 misses units with no entry yet: match in Python."""
        follow = journalctl_argv(ReaderSettings(units=(UNIT,)), None)
        once = journalctl_argv(ReaderSettings(units=(UNIT,), follow=False), None)
        assert f"--unit={UNIT}" not in follow
        assert f"--unit={UNIT}" in once

    def test_a_catch_up_matches_the_units_fields_through_the_index(self) -> None:
        """Catching up, journalctl gets the units' three fields as matches, ORed with `+`,
        reads once (no --follow) from the inclusive cursor, every field."""
        argv = catch_up_argv(ReaderSettings(units=(UNIT, "b.service")), "s=1;i=2")
        assert argv[-8:] == [
            f"_SYSTEMD_UNIT={UNIT}", "_SYSTEMD_UNIT=b.service", "+",
            f"UNIT={UNIT}", "UNIT=b.service", "+",
            f"OBJECT_SYSTEMD_UNIT={UNIT}", "OBJECT_SYSTEMD_UNIT=b.service",
        ]  # fmt: skip
        assert "--cursor=s=1;i=2" in argv
        assert not any(a.startswith(("--follow", "--unit", "--output-fields")) for a in argv)

    @pytest.mark.parametrize(("start", "flag"), [("tail", "--lines=0"), ("head", "--no-tail")])
    def test_start_position_without_cursor(self, start: str, flag: str) -> None:
        """With no saved cursor the reader starts at the tail or the head as configured."""
        assert flag in journalctl_argv(ReaderSettings(start_at=start), None)


async def _run_child(argv: list[str]) -> tuple[int, list[str]]:
    """Run a reader child to its end: its exit status and its stderr lines."""
    child = await asyncio.create_subprocess_exec(
        *argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    _, errors = await asyncio.wait_for(child.communicate(), 30)
    return child.returncode or 0, errors.decode().splitlines()


class TestRefusedCursor:
    """Only a failed seek drops the saved cursor; any other failure keeps it."""

    async def test_a_usage_error_naming_cursor_keeps_the_cursor(self, journal_dir: Path) -> None:
        """The program's usage line names `--cursor`: not a refusal of the saved one."""
        status, errors = await _run_child([str(NATIVE_READER), "--bogus"])
        assert status == 2 and any("--cursor" in line for line in errors)
        reader = JournalctlReader(ReaderSettings(directory=journal_dir), cursor="s=1;i=2")
        await reader._after_exit(status, errors)
        assert reader.cursor == "s=1;i=2"
        assert not reader.cursor_rejected

    async def test_a_failed_seek_drops_it(self, journal_dir: Path, writer: JournalWriter) -> None:
        writer.write(service_lines(UNIT, "a" * 32, ["one line"]))
        argv = native_argv(ReaderSettings(directory=journal_dir, follow=False), "s=bogus")
        status, errors = await _run_child(argv)
        assert errors[0].startswith("Failed to seek to cursor")
        reader = JournalctlReader(ReaderSettings(directory=journal_dir), cursor="s=bogus")
        await reader._after_exit(status, errors)
        assert reader.cursor is None
        assert reader.cursor_rejected


class TestLostExitStatus:
    """asyncio's 255 for an exit status another reaped, with nothing on stderr, is no failure
    (seen in CI under load: "exit status already read: will report returncode 255")."""

    async def test_a_silent_255_is_no_failure_and_a_said_one_is(self, journal_dir: Path) -> None:
        reader = JournalctlReader(ReaderSettings(directory=journal_dir, follow=False))
        await reader._after_exit(255, [])
        assert reader.last_error is None
        with pytest.raises(JournalError, match="Failed to open"):
            await reader._after_exit(255, ["Failed to open files: Permission denied"])
        with pytest.raises(JournalError, match="exit status 1"):
            await reader._after_exit(1, [])


class TestFailingChild:
    """A child that cannot start is restarted with backoff, and said to be failing."""

    async def test_repeated_failures_are_an_error_naming_the_childs_complaint(
        self, tmp_path: Path, source: str
    ) -> None:
        """A journal directory that is a file: after 3 failed starts in a row each further one
        is logged as an error with the child's own message, counted in `failures`."""
        not_a_directory = tmp_path / "file"
        not_a_directory.write_text("")
        settings = ReaderSettings(
            directory=not_a_directory, units=(UNIT,), backoff_s=0.01, source=source
        )
        reader = JournalctlReader(settings)
        stop = asyncio.Event()
        with structlog.testing.capture_logs() as logs:
            task = asyncio.create_task(_collect(reader, stop, 1, []))
            try:
                await poll(lambda: reader.failures >= 4, within=20)
            finally:
                stop.set()
                await asyncio.wait_for(task, 10)
        failing = [e for e in logs if e["event"] == "journal_reader_failing"]
        assert failing and failing[0]["failures"] == 3
        assert failing[0]["log_level"] == "error"
        assert "Not a directory" in failing[0]["error"]
        assert reader.restarts >= 4


class TestRealJournal:
    """Reading and following journals written by journal-remote."""

    async def test_reads_unit_lines_and_pid1_messages(self, journal_dir: Path, source: str) -> None:
        """-u matches the service's own lines and PID 1's messages about it, nothing else."""
        with JournalWriter(journal_dir) as writer:
            writer.write(crashed_invocation(UNIT, ["boom"], restarts=1))
            writer.write(service_lines("other.service", "x" * 32, ["not ours"]))
        settings = ReaderSettings(directory=journal_dir, units=(UNIT,), follow=False, source=source)
        entries = [e async for batch in read_all(settings) for e in batch]
        assert "not ours" not in [e.message for e in entries]
        # Starting, Started, the line, exited, failed, restart scheduled, stopped (restart job)
        assert [e.message_id is not None for e in entries] == [True, True, False] + [True] * 4
        assert {e.unit for e in entries} == {UNIT}

    async def test_binary_long_and_bad_fields_are_decoded(
        self, journal_dir: Path, source: str
    ) -> None:
        """\\r, non-UTF-8, NUL and >4 KiB messages arrive decoded, none lost; a line over
        max_line_chars keeps its head and ends in the cut marker."""
        inv = "a" * 32
        special = [b"bar 1%\rbar 99%", b"\xff\xfe\xfd", b"nul\x00inside", b"L" * 70_000]
        with JournalWriter(journal_dir) as writer:
            writer.write(
                {**e, "MESSAGE": m}
                for e, m in zip(service_lines(UNIT, inv, ["x"] * 4), special, strict=True)
            )
        settings = ReaderSettings(directory=journal_dir, units=(UNIT,), follow=False, source=source)
        messages = [e.message async for batch in read_all(settings) for e in batch]
        assert messages[0] == "bar 99%"
        assert messages[1] == "\ufffd\ufffd\ufffd"
        assert messages[2] == "nul\\x00inside"
        assert messages[3] == "L" * (16384 - len(CUT_MARKER)) + CUT_MARKER

    async def test_follow_kill_and_resume_loses_and_repeats_nothing(
        self, journal_dir: Path, source: str, writer: JournalWriter
    ) -> None:
        """Killing journalctl and restarting the reader from its cursor yields each entry once."""
        inv = "b" * 32
        writer.write(service_lines(UNIT, inv, _lines("early", 300)))
        settings = ReaderSettings(
            directory=journal_dir, units=(UNIT,), start_at="head", backoff_s=0.05, source=source
        )
        states: list[bool] = []
        reader = JournalctlReader(settings, on_following=states.append)
        got: list[str] = []
        stop = asyncio.Event()
        task = asyncio.create_task(_collect(reader, stop, 900, got))
        await asyncio.wait_for(reader.following.wait(), 20)
        await poll(lambda: len(got) >= 300, within=20, each=writer.nudge)
        # Kill the following child mid-stream (our own child, by PID; not one of journalctl's
        # catch-up runs before it), then write more while it is down.
        await poll(lambda: reader._process is not None and "--follow" in reader._argv)
        assert reader._process is not None
        os.kill(reader._process.pid, signal.SIGKILL)
        writer.write(service_lines(UNIT, inv, _lines("middle", 300)))
        await poll(lambda: reader.restarts >= 1, within=20)
        writer.write(service_lines(UNIT, inv, _lines("late", 300)))
        await poll(task.done, within=20, each=writer.nudge)
        # A brand-new reader from the saved cursor sees only what came after it.
        writer.write(service_lines(UNIT, inv, _lines("after", 50)))
        resumed = JournalctlReader(settings, cursor=reader.cursor)
        more: list[str] = []
        resume = asyncio.create_task(_collect(resumed, asyncio.Event(), 50, more))
        await poll(resume.done, within=20, each=writer.nudge)
        expected = _lines("early", 300) + _lines("middle", 300) + _lines("late", 300)
        assert states[:3] == [True, False, True]  # followed, lost with the kill, followed again
        assert got == expected
        assert more == _lines("after", 50)

    async def test_follows_a_unit_that_had_not_logged_yet(
        self, journal_dir: Path, source: str, writer: JournalWriter
    ) -> None:
        """Entries of a unit that first logs after the reader started arrive; others do not."""
        writer.write(service_lines("other.service", "d" * 32, _lines("other", 5)))
        settings = ReaderSettings(
            directory=journal_dir, units=(UNIT,), start_at="head", backoff_s=0.05, source=source
        )
        reader = JournalctlReader(settings)
        got: list[str] = []
        task = asyncio.create_task(_collect(reader, asyncio.Event(), 3, got))
        await asyncio.wait_for(reader.following.wait(), 20)
        writer.write(service_lines(UNIT, "e" * 32, _lines("ours", 3)))
        writer.write(service_lines("other.service", "d" * 32, _lines("other-late", 2)))
        await poll(task.done, within=20, each=writer.nudge)
        assert got == _lines("ours", 3)

    async def test_tail_start_is_pinned_before_following_is_announced(
        self, journal_dir: Path, source: str, writer: JournalWriter
    ) -> None:
        """Starting at the tail skips the past, and nothing written after `following` is lost."""
        writer.write(service_lines(UNIT, "f" * 32, _lines("past", 4)))
        settings = ReaderSettings(
            directory=journal_dir, units=(UNIT,), start_at="tail", source=source
        )
        once = dataclasses.replace(settings, follow=False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        # The past must be on disk before the reader starts, or it would not be "the past".
        while await _read_or_empty(once) != _lines("past", 4):
            assert loop.time() < deadline, "journal-remote never wrote the first entries"
            await asyncio.sleep(0.05)
        reader = JournalctlReader(settings)
        got: list[str] = []
        task = asyncio.create_task(_collect(reader, asyncio.Event(), 2, got))
        await asyncio.wait_for(reader.following.wait(), 20)
        writer.write(service_lines(UNIT, "f" * 32, _lines("new", 2)))
        await poll(task.done, within=20, each=writer.nudge)
        assert got == _lines("new", 2)

    async def test_unparsable_cursor_falls_back_instead_of_crash_looping(
        self, journal_dir: Path, source: str, writer: JournalWriter
    ) -> None:
        """A corrupt saved cursor is dropped with a warning and reading goes on."""
        writer.write(service_lines(UNIT, "c" * 32, _lines("line", 5)))
        settings = ReaderSettings(
            directory=journal_dir, units=(UNIT,), start_at="head", backoff_s=0.05, source=source
        )
        reader = JournalctlReader(settings, cursor="garbage-cursor")
        got: list[str] = []
        await asyncio.wait_for(_collect(reader, asyncio.Event(), 5, got), 30)
        assert got == _lines("line", 5)


async def _read_or_empty(settings: ReaderSettings) -> list[str]:
    """The messages of a journal journal-remote may still be creating (then: none yet)."""
    try:
        return [e.message async for batch in read_all(settings) for e in batch]
    except JournalError:
        return []


class TestSourceChoice:
    """Which child runs: the native reader when built, journalctl otherwise or on request."""

    def test_auto_prefers_the_native_reader_when_built(self) -> None:
        """'auto' runs the libsystemd child, which this checkout builds (libsystemd-dev)."""
        argv = reader_argv(ReaderSettings(units=(UNIT,), source="auto"), None)
        assert argv[0] == str(NATIVE_READER)
        assert Path(argv[0]).name == "vllm-supervisor-journal-reader"

    def test_journalctl_can_be_forced(self) -> None:
        """reader = 'journalctl' keeps the journalctl child even when native is built."""
        argv = reader_argv(ReaderSettings(source="journalctl", journalctl="/bin/jctl"), None)
        assert argv[0] == "/bin/jctl"

    def test_unknown_source_is_refused(self) -> None:
        """A misspelt source is an error naming the choices, not a silent fallback."""
        with pytest.raises(JournalError, match="one of auto, native, journalctl"):
            resolve_source("systemd-python")

    @pytest.mark.parametrize(
        ("follow", "cursor", "expected"),
        [
            (True, None, ["--follow", "--linger-ms=100", "--start=tail"]),  # pinned by cursor first
            (True, "s=1;i=2", ["--follow", "--linger-ms=100", "--cursor=s=1;i=2"]),  # inclusive
            (False, None, ["--start=head"]),  # read once: the whole journal
        ],
    )
    def test_native_start_points(
        self, follow: bool, cursor: str | None, expected: list[str]
    ) -> None:
        """The native child takes the same start points as journalctl's argv."""
        settings = ReaderSettings(units=(UNIT,), follow=follow, start_at="tail")
        argv = native_argv(settings, cursor)
        assert expected == argv[-len(expected) :]
        assert "--units-from-stdin" in argv
        assert native_input(settings) == f"{UNIT}\n\n".encode()


class TestRotation:
    """journald's rotation and vacuum under a follower: the crash-isolation the child exists for."""

    async def test_rotation_vacuum_and_a_truncated_file_lose_nothing(
        self, journal_dir: Path, source: str
    ) -> None:
        """Rotate, vacuum and truncate journal files while following: every entry exactly once.

        1. `remote.journal` is archived under journald's name for rotated files and a new active
           file is started; 2. the archived file is deleted (vacuum); 3. another archived file the
        reader has mapped is truncated to nothing, which is what made libsystemd readers die with
        SIGBUS before systemd 255. If the child dies, the reader restarts it from its cursor.
        """
        # Without the linger the child reads at each change, which is what meets the truncated
        # file's mapping on 252 (with it, the reads fall between the steps).
        settings = ReaderSettings(
            directory=journal_dir,
            units=(UNIT,),
            start_at="head",
            backoff_s=0.05,
            source=source,
            linger_ms=0,
        )
        reader = JournalctlReader(settings)
        got: list[str] = []
        expected: list[str] = []
        task = asyncio.create_task(_collect(reader, asyncio.Event(), 10**9, got))
        writer = JournalWriter(journal_dir)
        try:
            for step in ("gen1", "gen2", "gen3", "gen4"):
                if step != "gen1":
                    writer = _rotate(journal_dir, writer, step)
                lines = _lines(step, 200)
                writer.write(service_lines(UNIT, "9" * 32, lines))
                expected += lines
                want = len(expected)
                await poll(lambda want=want: len(got) >= want, within=30, each=writer.nudge)
        finally:
            writer.close()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await reader.aclose()
        assert expected == got
        if source == "native":
            # On systemd 252 the libsystemd child dies of SIGBUS (exit -7) on the truncated file;
            # the restart from its cursor is what kept every entry above.
            assert reader.restarts >= 1


def _rotate(directory: Path, writer: JournalWriter, step: str) -> JournalWriter:
    """Archive `remote.journal` under journald's rotated-file name; a new writer continues.

    Before gen3 the oldest archived file is also deleted (vacuum); before gen4 the newest
    archived one, which the reader has mapped, is truncated to nothing.
    """
    writer.close()
    factory = writer.factory
    archived = f"remote@{factory.seqnum_id}-{factory.seqnum:016x}-{factory.clock_us:016x}.journal"
    (directory / "remote.journal").rename(directory / archived)
    if step == "gen3":
        min(directory.glob("remote@*.journal")).unlink()
    if step == "gen4":
        os.truncate(max(directory.glob("remote@*.journal")), 0)
    return JournalWriter(directory, factory=factory)


class TestSync:
    """`sync`: everything in the journal files before it was asked has been handed over."""

    async def test_a_sync_covers_every_entry_written_before_it(self, journal_dir: Path) -> None:
        """Entries in the file but never announced by a change notification (journald's is
        up to 250 ms late on 252) are read and handled before the sync answers."""
        settings = ReaderSettings(
            directory=journal_dir, units=(UNIT,), start_at="head", source="native"
        )
        reader = JournalctlReader(settings)
        got: list[str] = []
        stop = asyncio.Event()
        task = asyncio.create_task(_collect(reader, stop, 10**9, got))
        try:
            with JournalWriter(journal_dir) as writer:
                await asyncio.wait_for(reader.following.wait(), 10)
                lines = _lines("unannounced", 50)
                writer.write(service_lines(UNIT, "7" * 32, lines))
                await poll(lambda: _in_file(journal_dir) >= 50, within=10)
                assert await reader.sync(10)
                assert got == lines  # handled by the consumer before the answer
                more = _lines("more", 3)
                writer.write(service_lines(UNIT, "7" * 32, more))
                await poll(lambda: _in_file(journal_dir) >= 53, within=10)
                assert await reader.sync(10)
                assert got == lines + more
        finally:
            stop.set()
            await task
            await reader.aclose()

    async def test_journalctl_cannot_be_asked(self, journal_dir: Path) -> None:
        """The journalctl fallback takes no requests: a sync says so at once."""
        with JournalWriter(journal_dir) as writer:
            writer.write(service_lines(UNIT, "7" * 32, ["one"]))
        settings = ReaderSettings(directory=journal_dir, units=(UNIT,), source="journalctl")
        reader = JournalctlReader(settings)
        stop = asyncio.Event()
        task = asyncio.create_task(_collect(reader, stop, 1, []))
        await asyncio.wait_for(reader.following.wait(), 10)
        assert not await reader.sync(0.5)
        stop.set()
        await task
        await reader.aclose()


def _in_file(directory: Path) -> int:
    """How many entries the journal files hold (journalctl, read once)."""
    out = subprocess.run(
        ["journalctl", "-D", str(directory), "-o", "cat", "--no-pager"],
        capture_output=True,
        check=False,
    ).stdout
    return len(out.splitlines())


class TestEmptyJournal:
    """A journal directory with no file yet (journal-remote's before the first upload, a fresh
    volatile journal): journalctl 252 refuses to follow it ("Data from the specified boot (+0)
    is not available"), which restarted the fallback reader forever and called it failing."""

    @pytest.mark.parametrize("start_at", ["tail", "head"])
    async def test_entries_written_later_are_read_and_nothing_failed(
        self, journal_dir: Path, source: str, start_at: str
    ) -> None:
        settings = ReaderSettings(
            directory=journal_dir,
            units=(UNIT,),
            start_at=start_at,
            source=source,
            backoff_s=0.05,
            backoff_max_s=0.2,
        )
        reader = JournalctlReader(settings)
        stop = asyncio.Event()
        got: list[str] = []
        with structlog.testing.capture_logs() as logs:
            task = asyncio.create_task(_collect(reader, stop, 3, got))
            await asyncio.wait_for(reader.following.wait(), 10)
            # journalctl met the empty journal (the native child follows it as it is).
            await poll(
                lambda: (
                    source == "native"
                    or any(e["event"] in ("journal_empty", "journalctl_failed") for e in logs)
                ),
                within=10,
            )
            with JournalWriter(journal_dir) as writer:
                writer.write(service_lines(UNIT, "5" * 32, _lines("late", 3)))
                await poll(lambda: task.done(), within=20, each=writer.nudge)
        await task
        await reader.aclose()
        assert got == _lines("late", 3)
        assert (reader.restarts, reader.failures, reader.last_error) == (0, 0, None), logs
        assert not [e for e in logs if e["log_level"] in ("warning", "error")], logs
