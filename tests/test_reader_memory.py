"""The reader child under journal entries of 16 MiB: its memory, and what it hands the daemon.

journald takes a native entry of up to 768 MiB from any local user. libsystemd 252 decompresses a
field whole whatever `sd_journal_set_data_threshold` says, and keeps, for every journal file it
has open, a buffer as large as the largest field it decompressed there until that file is
closed. Reading a backlog of such entries (a restart of the daemon, a resume from its cursor)
spread over journald's rotated files held one such buffer per file. These tests write real
journal files with the repository's writer (journal-remote), read them with the real child as
the daemon runs it, and measure the child in /proc.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from conftest import poll
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_supervisor.journal import export
from vllm_supervisor.journal.export import message_text
from vllm_supervisor.journal.reader import (
    JournalctlReader,
    ReaderSettings,
    native_argv,
    native_input,
    read_all,
)
from vllm_supervisor.journal.writer import JournalWriter, service_lines

T = TypeVar("T")
UNIT = "vllm.service"
INVOCATION = "c" * 32
MIB = 1 << 20
BIG = 16 * MIB
ENTRIES = 60
PER_FILE = 3  # 20 journal files: journald rotates a file of a few such entries
# After the flood has been read, the child holds its program, one output buffer (1 MiB) and one
# entry's wanted fields, each cut to the data threshold (~64 KiB): about 3 MB in all. 8 MiB of
# anonymous memory leaves room for the allocator; before the fix it held ~16 MiB per file read.
ANON_AFTER_BYTES = 8 * MIB
# While reading, one field is decompressed at a time (16 MiB here) and the journal is opened
# again once oversized fields were read: at most one buffer of 16 MiB lives next to the program.
PEAK_BYTES = 48 * MIB


def _flood_line(n: int) -> bytes:
    """A 16 MiB line whose head a signature could match (stored compressed: it repeats). It
    ends in a newline, which has the writer send it as a binary field without looking at each
    of its bytes for one that is not printable (seconds per entry in Python)."""
    head = b"RuntimeError: CUDA error: out of memory (flood %d) " % n
    return head + b"%d " % n * ((BIG - len(head) - 1) // len(b"%d " % n)) + b"\n"


def _status(pid: int) -> dict[str, int]:
    """The child's memory as /proc/PID/status reports it, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if value.strip().endswith(" kB"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


def _child_status(reader: JournalctlReader) -> dict[str, int]:
    assert reader._process is not None
    return _status(reader._process.pid)


async def _follow_until(
    reader: JournalctlReader,
    want: int,
    probe: Callable[[JournalctlReader], T] = _child_status,  # type: ignore[assignment]
) -> tuple[list[str], T]:
    """Follow until `want` entries arrived and the child answered a sync request after them;
    then the messages and what `probe` found at that moment (the child still runs)."""
    got: list[str] = []
    stop = asyncio.Event()

    async def collect() -> None:
        async for batch in reader.batches(stop):
            got.extend(entry.message for entry in batch)

    task = asyncio.create_task(collect())
    try:
        await poll(lambda: len(got) >= want, within=180)
        assert await reader.sync(60), "the child answered no sync request"
        found = probe(reader)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    return got, found


async def test_memory_is_bounded_after_reading_60_entries_of_16_mib(journal_dir: Path) -> None:
    """60 entries of 16 MiB over 20 files: afterwards the child holds less than 8 MiB of
    anonymous memory, and never more than 48 MiB of memory while it reads them."""
    with JournalWriter(journal_dir) as writer:
        for n in range(ENTRIES):
            writer.write(service_lines(UNIT, INVOCATION, [_flood_line(n)]))
            if n % PER_FILE == PER_FILE - 1:
                writer.rotate()
        writer.write(service_lines(UNIT, INVOCATION, ["after the flood"]))
    reader = JournalctlReader(
        ReaderSettings(directory=journal_dir, units=(UNIT,), start_at="head", source="native")
    )
    messages, memory = await _follow_until(reader, ENTRIES + 1)
    assert len(messages) == ENTRIES + 1  # each once, through the reopens
    assert messages[-1] == "after the flood"
    for n, message in enumerate(messages[:-1]):
        assert message.startswith(f"RuntimeError: CUDA error: out of memory (flood {n}) ")
    assert memory["RssAnon"] <= ANON_AFTER_BYTES, memory
    assert memory["VmHWM"] <= PEAK_BYTES, memory


async def test_following_through_reopens_loses_and_repeats_nothing(
    journal_dir: Path, writer: JournalWriter
) -> None:
    """Lines over the threshold arriving while the child follows make it reopen the journal at
    the end of each pass; every line written around them still arrives once, in order."""
    reader = JournalctlReader(
        ReaderSettings(directory=journal_dir, units=(UNIT,), start_at="head", source="native")
    )
    got: list[str] = []
    stop = asyncio.Event()

    async def collect() -> None:
        async for batch in reader.batches(stop):
            got.extend(entry.message[:12] for entry in batch)

    task = asyncio.create_task(collect())
    expected: list[str] = []
    try:
        await asyncio.wait_for(reader.following.wait(), 20)
        for n in range(6):
            lines = [f"line {n} a", f"long {n} " + "z" * MIB, f"line {n} b"]
            writer.write(service_lines(UNIT, INVOCATION, lines))
            expected += [line[:12] for line in lines]
            want = len(expected)
            await poll(lambda: len(got) >= want, within=30, each=writer.nudge)  # noqa: B023
        assert await reader.sync(30)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert got == expected


def _write_flood_between_lines(journal_dir: Path) -> None:
    with JournalWriter(journal_dir) as writer:
        lines = service_lines(UNIT, INVOCATION, ["INFO before", "x", "INFO after"])
        before, big, after = list(lines)
        writer.write([before, {**big, "MESSAGE": _flood_line(0), "PRIORITY": 3}, after])


def test_the_child_hands_over_no_more_than_the_data_threshold(journal_dir: Path) -> None:
    """A 16 MiB message crosses the pipe cut to the threshold the daemon asked for."""
    _write_flood_between_lines(journal_dir)
    settings = ReaderSettings(directory=journal_dir, units=(UNIT,), follow=False)
    result = subprocess.run(
        native_argv(settings, None),
        input=native_input(settings),
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    threshold = settings.max_line_chars * 4 + 64
    assert threshold < len(result.stdout) < threshold + 4096  # one cut message, three rows


@pytest.mark.parametrize("source", ["native", "journalctl"])
async def test_a_cut_message_keeps_its_head_its_fields_and_a_marker(
    journal_dir: Path, source: str
) -> None:
    """The daemon sees the lines around the flood whole, and the flood's head with its
    priority, unit and invocation, cut to max_line_chars characters ending in the marker."""
    _write_flood_between_lines(journal_dir)
    settings = ReaderSettings(directory=journal_dir, units=(UNIT,), follow=False, source=source)
    entries = [e async for batch in read_all(settings) for e in batch]
    assert [e.message for e in entries][::2] == ["INFO before", "INFO after"]
    cut = entries[1]
    assert cut.message.startswith("RuntimeError: CUDA error: out of memory (flood 0) 0 0 ")
    assert cut.message.endswith(export.CUT_MARKER)
    assert len(cut.message) == settings.max_line_chars
    assert (cut.priority, cut.unit, cut.invocation_id) == (3, UNIT, INVOCATION)


@pytest.mark.parametrize("source", ["native", "journalctl"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    messages=st.lists(
        st.one_of(
            st.binary(max_size=200),
            st.text(max_size=120).map(str.encode),
            st.builds(
                lambda head, n: head * n, st.binary(min_size=1, max_size=3), st.integers(0, 90)
            ),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_what_the_daemon_sees_never_depends_on_the_childs_cut(
    tmp_path_factory: pytest.TempPathFactory, source: str, messages: list[bytes]
) -> None:
    """Any message, read through either child, decodes as the whole message would: the child's
    cut at the data threshold is invisible (here max_line_chars=16: a threshold of 128 bytes)."""
    journal_dir = tmp_path_factory.mktemp("journal")
    with JournalWriter(journal_dir) as writer:
        lines = service_lines(UNIT, INVOCATION, ["x"] * len(messages))
        writer.write({**line, "MESSAGE": m} for line, m in zip(lines, messages, strict=True))
    settings = ReaderSettings(
        directory=journal_dir, units=(UNIT,), follow=False, source=source, max_line_chars=16
    )

    async def read() -> list[str]:
        return [e.message async for batch in read_all(settings) for e in batch]

    assert asyncio.run(read()) == [message_text(m, 16) for m in messages]


async def test_the_childs_memory_is_read_from_proc_while_it_runs(journal_dir: Path) -> None:
    """`memory_bytes` is the running child's resident set, None before it starts and after."""
    with JournalWriter(journal_dir) as writer:
        writer.write(service_lines(UNIT, INVOCATION, ["one line"]))
    reader = JournalctlReader(
        ReaderSettings(directory=journal_dir, units=(UNIT,), start_at="head", source="native")
    )
    assert reader.memory_bytes() is None
    _, (gauge, memory) = await _follow_until(
        reader, 1, lambda r: (r.memory_bytes(), _child_status(r))
    )
    assert gauge is not None
    # Read a moment apart: the same resident set, give or take a few pages.
    assert abs(gauge - memory["VmRSS"]) <= 256 * 1024, (gauge, memory)
    assert reader.memory_bytes() is None  # the child was stopped with the follower
