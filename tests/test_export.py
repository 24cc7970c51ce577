"""The export-format parser and the decoding of entries into JournalEntry."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_supervisor.journal.export import (
    LINE_FIELDS,
    ExportParser,
    LineParser,
    decode,
    message_text,
)
from vllm_supervisor.journal.writer import EntryFactory, export_entry
from vllm_supervisor.model import JournalEntry, LifecycleEvent


def _stream() -> bytes:
    factory = EntryFactory()
    entries = [
        {"MESSAGE": "plain", "_SYSTEMD_UNIT": "vllm.service", "_PID": "7"},
        {"MESSAGE": b"tqdm 10%\rtqdm 20%\r", "_SYSTEMD_UNIT": "vllm.service"},
        {"MESSAGE": b"two\n\nblank lines", "X": b"\x00\x01\n\n"},
        {"MESSAGE": b"\xff\xfe not utf-8", "_SYSTEMD_UNIT": "vllm.service"},
    ]
    return b"".join(factory.entry(e) for e in entries)


class TestExportParser:
    """Chunked parsing of journal export format."""

    @pytest.mark.parametrize("chunk", [1, 2, 7, 64, 10_000])
    def test_any_chunking_gives_the_same_entries(self, chunk: int) -> None:
        """Entries come out whole and in order however the pipe splits the bytes."""
        data = _stream()
        parser = ExportParser()
        entries = []
        for start in range(0, len(data), chunk):
            entries += parser.feed(data[start : start + chunk])
        assert [e[b"MESSAGE"] for e in entries] == [
            b"plain",
            b"tqdm 10%\rtqdm 20%\r",
            b"two\n\nblank lines",
            b"\xff\xfe not utf-8",
        ]
        assert entries[2][b"X"] == b"\x00\x01\n\n"

    def test_incomplete_entry_waits_for_more(self) -> None:
        """A half-written entry is kept until its blank line arrives."""
        data = export_entry({"__CURSOR": "c1", "MESSAGE": "x"})
        parser = ExportParser()
        assert parser.feed(data[:-1]) == []
        assert [e[b"__CURSOR"] for e in parser.feed(data[-1:])] == [b"c1"]

    def test_absurd_binary_length_resynchronises(self) -> None:
        """A corrupt length does not make the parser buffer forever."""
        bad = b"MESSAGE\n" + (1 << 60).to_bytes(8, "little") + b"junk\n\n"
        good = export_entry({"__CURSOR": "c2", "MESSAGE": "after"})
        parser = ExportParser()
        entries = parser.feed(bad + good)
        assert parser.invalid == 1
        assert [e[b"MESSAGE"] for e in entries if b"__CURSOR" in e] == [b"after"]


class TestDecode:
    """Turning raw fields into the pipeline's JournalEntry."""

    def test_entry_is_the_same_frozen_value_the_dataclass_builds(self) -> None:
        """The fast constructor yields an equal JournalEntry that still refuses changes."""
        fields = {
            b"__CURSOR": b"s=1;i=2",
            b"__REALTIME_TIMESTAMP": b"1700000000000000",
            b"MESSAGE": b"hello",
            b"_PID": b"42",
            b"PRIORITY": b"3",
            b"_SYSTEMD_UNIT": b"vllm.service",
            b"_SYSTEMD_INVOCATION_ID": b"ab" * 16,
        }
        entry = decode(fields)
        expected = JournalEntry(
            cursor="s=1;i=2",
            realtime_us=1_700_000_000_000_000,
            message="hello",
            unit="vllm.service",
            invocation_id="ab" * 16,
            pid=42,
            priority=3,
        )
        assert expected == entry
        with pytest.raises(dataclasses.FrozenInstanceError):
            entry.message = "changed"  # type: ignore[misc, union-attr]

    def test_service_line_is_about_its_own_unit(self) -> None:
        """A service's line names the unit and invocation from the trusted fields."""
        entry = decode(
            {
                b"__CURSOR": b"c",
                b"__REALTIME_TIMESTAMP": b"5",
                b"MESSAGE": b"hi",
                b"_SYSTEMD_UNIT": b"vllm.service",
                b"_SYSTEMD_INVOCATION_ID": b"abc",
                b"_PID": b"12",
                b"PRIORITY": b"6",
            }
        )
        assert entry is not None
        assert (entry.unit, entry.invocation_id, entry.pid, entry.priority) == (
            "vllm.service",
            "abc",
            12,
            6,
        )
        assert not entry.from_pid1

    def test_pid1_message_is_about_the_unit_it_names(self) -> None:
        """PID 1's lifecycle message is attributed to UNIT=, not to init.scope."""
        entry = decode(
            {
                b"__CURSOR": b"c",
                b"MESSAGE": b"vllm.service: Main process exited",
                b"_SYSTEMD_UNIT": b"init.scope",
                b"_PID": b"1",
                b"UNIT": b"vllm.service",
                b"INVOCATION_ID": b"abc",
                b"MESSAGE_ID": LifecycleEvent.PROCESS_EXITED.value.encode(),
                b"EXIT_CODE": b"exited",
                b"EXIT_STATUS": b"1",
            }
        )
        assert entry is not None
        assert (entry.unit, entry.invocation_id, entry.from_pid1) == ("vllm.service", "abc", True)
        assert dict(entry.fields) == {"EXIT_CODE": "exited", "EXIT_STATUS": "1"}

    def test_entry_without_cursor_is_dropped(self) -> None:
        """An entry without a cursor cannot be checkpointed, so it is not an entry."""
        assert decode({b"MESSAGE": b"x"}) is None

    def test_bad_numbers_do_not_raise(self) -> None:
        """A non-numeric _PID or PRIORITY becomes None instead of an error."""
        entry = decode({b"__CURSOR": b"c", b"_PID": b"x", b"PRIORITY": b"", b"MESSAGE": b"m"})
        assert entry is not None
        assert (entry.pid, entry.priority) == (None, None)


class TestMessageText:
    """What a MESSAGE looks like once decoded."""

    @pytest.mark.parametrize(
        ("raw", "expected"),
        [
            (b"Loading 10%\rLoading 55%\rLoading 100%", "Loading 100%"),  # tqdm: the last state
            (b"line with CRLF\r", "line with CRLF"),
            (b"\r\r\r", ""),  # only carriage returns
            (b"nul\x00byte", "nul\\x00byte"),
            (b"\xff bad", "\ufffd bad"),
        ],
    )
    def test_decoding(self, raw: bytes, expected: str) -> None:
        """Control characters and bad bytes never break decoding."""
        assert message_text(raw, 100) == expected

    def test_megabyte_line_is_cut(self) -> None:
        """A 1 MB line is bounded to the configured number of characters."""
        assert len(message_text(b"x" * (1 << 20), 16384)) == 16384


def _row(cursor: str, message: bytes, **fields: str) -> bytes:
    """One entry in the native reader's lean framing (see `journal_reader.c`, write_lines)."""
    values = [fields.get(name.decode(), "").encode() for name in LINE_FIELDS]
    head = b"\t".join([cursor.encode(), b"1700000000000000", *values, str(len(message)).encode()])
    return head + b"\n" + message + b"\n"


class TestLineParser:
    """The native reader's lean framing: one row per entry, then the message."""

    def test_entries_match_what_decode_builds_from_the_same_fields(self) -> None:
        """A service line and a PID 1 lifecycle message decode as export format does."""
        stream = _row(
            "c1", b"hi", _SYSTEMD_UNIT="vllm.service", _SYSTEMD_INVOCATION_ID="ab", _PID="7"
        ) + _row(
            "c2",
            b"vllm.service: Main process exited, code=exited, status=1/FAILURE",
            MESSAGE_ID=LifecycleEvent.PROCESS_EXITED.value,
            _PID="1",
            _SYSTEMD_UNIT="init.scope",
            UNIT="vllm.service",
            INVOCATION_ID="ab",
            EXIT_CODE="exited",
            EXIT_STATUS="1",
        )
        entries, first, last = LineParser().feed(stream)
        exported = [
            decode(
                {
                    b"__CURSOR": b"c1",
                    b"__REALTIME_TIMESTAMP": b"1700000000000000",
                    b"MESSAGE": b"hi",
                    b"_SYSTEMD_UNIT": b"vllm.service",
                    b"_SYSTEMD_INVOCATION_ID": b"ab",
                    b"_PID": b"7",
                }
            ),
            decode(
                {
                    b"__CURSOR": b"c2",
                    b"__REALTIME_TIMESTAMP": b"1700000000000000",
                    b"MESSAGE": b"vllm.service: Main process exited, code=exited, status=1/FAILURE",
                    b"MESSAGE_ID": LifecycleEvent.PROCESS_EXITED.value.encode(),
                    b"_PID": b"1",
                    b"_SYSTEMD_UNIT": b"init.scope",
                    b"UNIT": b"vllm.service",
                    b"INVOCATION_ID": b"ab",
                    b"EXIT_CODE": b"exited",
                    b"EXIT_STATUS": b"1",
                }
            ),
        ]
        assert exported == entries
        assert (first, last) == (b"c1", b"c2")

    @pytest.mark.parametrize("cut", [1, 5, 40, 95, 100, 101])
    def test_any_chunk_boundary_gives_the_same_entries(self, cut: int) -> None:
        """Rows and messages split across reads (a message holding newlines) are reassembled."""
        stream = _row("c1", b"line\nwith\nnewlines") + b"c2\n" + _row("c3", b"\r99%")
        parser = LineParser()
        first_part, _, _ = parser.feed(stream[:cut])
        rest, _, last = parser.feed(stream[cut:])
        messages = [e.message for e in first_part + rest]
        assert messages == ["line\nwith\nnewlines", "99%"]
        assert last == b"c3"

    def test_cursor_only_record_moves_the_checkpoint(self) -> None:
        """A row with only a cursor yields no entry but is the last cursor read."""
        entries, first, last = LineParser().feed(_row("c1", b"x") + b"c9\n")
        assert ([e.cursor.encode() for e in entries], first, last) == ([b"c1"], b"c1", b"c9")

    def test_a_malformed_row_is_counted_and_skipped(self) -> None:
        """Bad data never raises: the row is counted and parsing resumes at the next line."""
        parser = LineParser()
        entries, _, _ = parser.feed(b"a\tb\tc\n" + _row("c1", b"ok"))
        assert ([e.message for e in entries], parser.invalid) == (["ok"], 1)


FORGED = {
    "MESSAGE_ID": LifecycleEvent.PROCESS_EXITED.value,
    "UNIT": "vllm.service",
    "INVOCATION_ID": "ab",
    "OBJECT_SYSTEMD_UNIT": "vllm.service",
    "_SYSTEMD_UNIT": "user@1000.service",
    "_SYSTEMD_INVOCATION_ID": "cd",
}


@pytest.mark.parametrize(
    ("sender", "unit"),
    [
        ({"_PID": "4321", "_UID": "1000"}, "user@1000.service"),  # sd_journal_send by a user
        ({"_PID": "4321"}, "user@1000.service"),  # no _UID: not trusted either
        ({"_PID": "1", "_UID": "0"}, "vllm.service"),  # systemd itself
        ({"_PID": "512", "_UID": "0"}, "vllm.service"),  # root: journald, systemd-coredump
    ],
)
def test_unit_fields_count_only_from_trusted_senders(sender: dict[str, str], unit: str) -> None:
    """UNIT=, INVOCATION_ID= and OBJECT_SYSTEMD_UNIT= from anyone but PID 1 or root are ignored."""
    fields = {**FORGED, **sender}
    exported = decode(
        {
            b"__CURSOR": b"c1",
            b"__REALTIME_TIMESTAMP": b"1700000000000000",
            b"MESSAGE": b"x",
            **{k.encode(): v.encode() for k, v in fields.items()},
        }
    )
    [native], _, _ = LineParser().feed(_row("c1", b"x", **fields))
    assert exported == native
    assert native.unit == unit
    assert native.invocation_id == ("ab" if unit == "vllm.service" else "cd")
