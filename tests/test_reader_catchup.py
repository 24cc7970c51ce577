"""The readers' catch-up through the journal's index, then following entry by entry.

A following child first reads the backlog through libsystemd's matches on the units' fields
(cost: the units' share of the journal), pins the journal's tail, and follows on each entry's
unit fields after it: the native child within itself, the journalctl fallback with matched
`journalctl` runs before its follower. What the daemon receives must not depend on where that
switch falls: every entry about the units once, in journal order, whatever was written while it
switched. Real journal files (journal-remote) and the real child; the reference is `journalctl
-o export` of the whole journal, filtered here on the three unit fields.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
from pathlib import Path

import pytest
from conftest import poll, wait_for
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_supervisor.journal.export import ExportParser
from vllm_supervisor.journal.reader import JournalctlReader, ReaderSettings, read_all
from vllm_supervisor.journal.writer import FieldValue, JournalWriter, vacuum_files

SUPERVISED = ("a.service", "b.service")
OTHER = "c.service"
# Past the child's MATCH_UNITS_MAX (64): the catch-up matches on each entry's fields instead.
MANY = (*SUPERVISED, *(f"idle-{n:03d}.service" for n in range(98)))
KINDS = ("line", "pid1", "object")


def entry(kind: str, unit: str, n: int) -> dict[str, FieldValue]:
    """A unit's own line, PID 1's message about it, or journald's (OBJECT_SYSTEMD_UNIT)."""
    message = f"{kind} {unit} {n}"
    if kind == "line":
        return {"_SYSTEMD_UNIT": unit, "_PID": 4000, "_SYSTEMD_INVOCATION_ID": "a" * 32,
                "MESSAGE": message}  # fmt: skip
    if kind == "pid1":
        return {"_SYSTEMD_UNIT": "init.scope", "_PID": 1, "_UID": 0, "UNIT": unit,
                "INVOCATION_ID": "a" * 32, "MESSAGE": message}  # fmt: skip
    return {"_SYSTEMD_UNIT": "systemd-journald.service", "_PID": 300, "_UID": 0,
            "OBJECT_SYSTEMD_UNIT": unit, "MESSAGE": message}  # fmt: skip


def journal_entries(directory: Path) -> list[tuple[str, str, bool]]:
    """(cursor, message, about a supervised unit) of every entry, by journalctl."""
    out = subprocess.run(
        ["journalctl", f"--directory={directory}", "--output=export", "--no-pager"],
        capture_output=True,
        check=True,
    ).stdout
    rows = []
    for fields in ExportParser().feed(out):
        units = {fields.get(f) for f in (b"_SYSTEMD_UNIT", b"UNIT", b"OBJECT_SYSTEMD_UNIT")}
        about = any(u.encode() in units for u in SUPERVISED)
        rows.append((fields[b"__CURSOR"].decode(), fields[b"MESSAGE"].decode(), about))
    return rows


def reader_for(
    directory: Path,
    units: tuple[str, ...],
    cursor: str | None,
    gaps: list[str],
    source: str = "native",
) -> JournalctlReader:
    return JournalctlReader(
        ReaderSettings(directory=directory, units=units, start_at="head", source=source),
        cursor=cursor,
        on_gap=lambda: gaps.append("gap"),
    )


SENTINEL = entry("line", SUPERVISED[0], -1)


async def follow_until_sentinel(reader: JournalctlReader, writer: JournalWriter) -> list[str]:
    """The messages handed over before SENTINEL, written once the reader follows (the journalctl
    child takes no sync requests: what came before it in the journal has arrived with it)."""
    got: list[str] = []
    stop = asyncio.Event()

    async def collect() -> None:
        async for batch in reader.batches(stop):
            got.extend(e.message for e in batch)
            if SENTINEL["MESSAGE"] in got:
                stop.set()

    task = asyncio.create_task(collect())
    try:
        await asyncio.wait_for(reader.following.wait(), 20)
        writer.write([SENTINEL])
        await poll(task.done, within=60, each=writer.nudge)
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    assert got[-1] == SENTINEL["MESSAGE"]
    return got[:-1]


async def follow_until_synced(
    reader: JournalctlReader, writing: threading.Thread | None = None
) -> list[str]:
    """The messages handed over until the child answered a sync request (asked once
    `writing`, if any, has finished), in order."""
    got: list[str] = []
    stop = asyncio.Event()

    async def collect() -> None:
        async for batch in reader.batches(stop):
            got.extend(e.message for e in batch)

    task = asyncio.create_task(collect())
    try:
        await asyncio.wait_for(reader.following.wait(), 20)
        if writing is not None:
            await asyncio.to_thread(writing.join, 60)
        assert await reader.sync(60), "no sync answer"
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    return got


SPEC = st.lists(
    st.tuples(st.sampled_from(KINDS), st.sampled_from((*SUPERVISED, OTHER))),
    min_size=1,
    max_size=40,
)


@pytest.mark.parametrize("units", [SUPERVISED, MANY], ids=["matched", "many-units"])
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(spec=SPEC, start=st.integers(-1, 39))
def test_each_entry_about_the_units_is_handed_over_once(
    tmp_path_factory: pytest.TempPathFactory,
    units: tuple[str, ...],
    spec: list[tuple[str, str]],
    start: int,
) -> None:
    """Any mix of the units' own lines, PID 1's and journald's messages about them and another
    unit's lines, from the head or from any saved cursor: each entry about the units after the
    start arrives once, in order; the checkpoint ends on the journal's last entry; no gap."""
    directory = tmp_path_factory.mktemp("journal")
    with JournalWriter(directory) as writer:
        writer.write(entry(kind, unit, n) for n, (kind, unit) in enumerate(spec))
    rows = journal_entries(directory)
    cursor = rows[start][0] if 0 <= start < len(rows) else None
    after = rows[start + 1 :] if cursor is not None else rows
    gaps: list[str] = []
    reader = reader_for(directory, units, cursor, gaps)
    got = asyncio.run(follow_until_synced(reader))
    assert got == [message for _, message, about in after if about]
    assert reader.cursor == rows[-1][0]
    assert gaps == []


@pytest.mark.parametrize("units", [SUPERVISED, MANY], ids=["matched", "many-units"])
async def test_entries_written_while_it_catches_up_arrive_once(
    journal_dir: Path, units: tuple[str, ...]
) -> None:
    """A backlog of 20,000 entries (a.service 1 % of them) is caught up while more of both
    kinds are written: every entry of a.service arrives once, in order."""
    writer = JournalWriter(journal_dir)
    try:
        writer.write(
            entry("line", "a.service" if n % 100 == 0 else OTHER, n) for n in range(20_000)
        )

        def write_more() -> None:
            for n in range(20_000, 22_000):
                writer.write([entry("line", "a.service" if n % 10 == 0 else OTHER, n)])
                if n % 100 == 0:
                    writer.nudge()
            # journal-remote writes what the pipe holds when it gets to it: the reader is asked
            # to sync only once the file holds the last entry.
            wait_for(lambda: len(journal_entries(journal_dir)) == 22_000, timeout=60)
            writer.nudge()

        writing = threading.Thread(target=write_more)
        reader = reader_for(journal_dir, units, None, [])
        writing.start()
        got = await follow_until_synced(reader, writing)
    finally:
        writer.close()
    expected = [m for _, m, about in journal_entries(journal_dir) if about]
    assert len(expected) == 200 + 200
    assert got == expected


@pytest.mark.parametrize("from_cursor", [False, True])
async def test_a_catch_up_that_stops_matching_midway_loses_nothing(
    journal_dir: Path, from_cursor: bool
) -> None:
    """Four units that are the whole journal: past the first 1,024 entries the matches cost
    more than looking at each entry, and the catch-up goes on without them (reading once too):
    every entry still arrives once, in order, from the head or from a cursor."""
    units = ("a.service", "b.service", "d.service", "e.service")
    with JournalWriter(journal_dir) as writer:
        writer.write(entry(KINDS[n % 3], units[n % 4], n) for n in range(5000))
    rows = journal_entries(journal_dir)
    cursor = rows[99][0] if from_cursor else None
    reader = reader_for(journal_dir, units, cursor, [])
    got = await follow_until_synced(reader)
    assert got == [message for _, message, _ in rows[100 if from_cursor else 0 :]]
    once = ReaderSettings(directory=journal_dir, units=units, follow=False, source="native")
    read: list[str] = []
    async for batch in read_all(once):
        read += [e.message for e in batch]
    assert read == [message for _, message, _ in rows]


async def test_a_vacuumed_saved_entry_is_a_gap_and_the_rest_arrives(journal_dir: Path) -> None:
    """The saved cursor's file was vacuumed: the gap is reported once, and every entry about
    the units in the files left arrives once."""
    writer = JournalWriter(journal_dir)
    try:
        writer.write(entry("line", "a.service", n) for n in range(5))
        writer.rotate()
        saved = journal_entries(journal_dir)[2][0]
        writer.write(entry("line", "a.service", n) for n in range(5, 10))
    finally:
        writer.close()
    vacuum_files(journal_dir, keep_files=1)
    gaps: list[str] = []
    got = await follow_until_synced(reader_for(journal_dir, SUPERVISED, saved, gaps))
    assert got == [f"line a.service {n}" for n in range(5, 10)]
    assert gaps == ["gap"]


@pytest.mark.parametrize("units", [SUPERVISED, MANY], ids=["matched", "many-units"])
@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(spec=SPEC, start=st.integers(-1, 39))
def test_the_journalctl_reader_hands_each_entry_over_once(
    tmp_path_factory: pytest.TempPathFactory,
    units: tuple[str, ...],
    spec: list[tuple[str, str]],
    start: int,
) -> None:
    """The fallback's catch-up (matched journalctl runs, then its follower after the pinned
    tail) hands over what following alone would: each entry about the units after the start
    once, in order, from the head or any saved cursor; no gap."""
    directory = tmp_path_factory.mktemp("journal")
    with JournalWriter(directory) as writer:
        writer.write(entry(kind, unit, n) for n, (kind, unit) in enumerate(spec))
    rows = journal_entries(directory)
    cursor = rows[start][0] if 0 <= start < len(rows) else None
    after = rows[start + 1 :] if cursor is not None else rows
    gaps: list[str] = []
    reader = reader_for(directory, units, cursor, gaps, source="journalctl")
    with JournalWriter(directory) as writer:
        got = asyncio.run(follow_until_sentinel(reader, writer))
    assert got == [message for _, message, about in after if about]
    assert reader.cursor == journal_entries(directory)[-1][0]
    assert gaps == []


async def test_the_journalctl_reader_reads_a_backlog_through_the_index(journal_dir: Path) -> None:
    """A backlog of 20,000 entries in which the units are 1 % (their lines, PID 1's and
    journald's messages about them): journalctl hands this process the entries about them, not
    every entry to be filtered here; what arrives is the same, and following goes on."""
    with JournalWriter(journal_dir) as writer:
        writer.write(
            entry(KINDS[n // 100 % 3], "a.service", n) if n % 100 == 0 else entry("line", OTHER, n)
            for n in range(20_000)
        )
    reader = reader_for(journal_dir, SUPERVISED, None, [], source="journalctl")
    with JournalWriter(journal_dir) as writer:
        got = await follow_until_sentinel(reader, writer)
    expected = [m for _, m, about in journal_entries(journal_dir) if about]
    assert len(expected) == 200 + 1
    assert got == expected[:-1]
    assert reader.parsed <= len(expected) + 10, "parsed every entry of the journal"


async def test_the_journalctl_reader_catches_up_while_entries_are_written(
    journal_dir: Path,
) -> None:
    """Entries of both kinds written while the fallback catches up arrive once, in order."""
    writer = JournalWriter(journal_dir)
    try:
        writer.write(
            entry("line", "a.service" if n % 100 == 0 else OTHER, n) for n in range(20_000)
        )

        def write_more() -> None:
            for n in range(20_000, 22_000):
                writer.write([entry("line", "a.service" if n % 10 == 0 else OTHER, n)])
                if n % 100 == 0:
                    writer.nudge()
            # journal-remote writes what the pipe holds when it gets to it: the reader is asked
            # to sync only once the file holds the last entry.
            wait_for(lambda: len(journal_entries(journal_dir)) == 22_000, timeout=60)
            writer.nudge()

        writing = threading.Thread(target=write_more)
        reader = reader_for(journal_dir, SUPERVISED, None, [], source="journalctl")
        writing.start()
        got: list[str] = []
        stop = asyncio.Event()

        async def collect() -> None:
            async for batch in reader.batches(stop):
                got.extend(e.message for e in batch)

        task = asyncio.create_task(collect())
        await asyncio.to_thread(writing.join, 60)
        await poll(lambda: len(got) >= 400, within=60, each=writer.nudge)
        writer.write([SENTINEL])
        await poll(lambda: SENTINEL["MESSAGE"] in got, within=60, each=writer.nudge)
        stop.set()
        await asyncio.wait_for(task, 30)
    finally:
        writer.close()
    expected = [m for _, m, about in journal_entries(journal_dir) if about]
    assert got == expected


async def test_the_journalctl_reader_reports_a_vacuumed_saved_entry(journal_dir: Path) -> None:
    """The fallback's catch-up checks where the saved cursor lands: a vacuumed entry is a gap,
    reported once, and the rest arrives once."""
    writer = JournalWriter(journal_dir)
    try:
        writer.write(entry("line", "a.service", n) for n in range(5))
        writer.rotate()
        saved = journal_entries(journal_dir)[2][0]
        writer.write(entry("line", "a.service", n) for n in range(5, 10))
    finally:
        writer.close()
    vacuum_files(journal_dir, keep_files=1)
    gaps: list[str] = []
    reader = reader_for(journal_dir, SUPERVISED, saved, gaps, source="journalctl")
    with JournalWriter(journal_dir) as writer:
        got = await follow_until_sentinel(reader, writer)
    assert got == [f"line a.service {n}" for n in range(5, 10)]
    assert gaps == ["gap"]
