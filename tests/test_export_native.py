"""The export format's C parser (`journal/_export.c`) does exactly what `ExportDecoder`'s
Python path does (`ExportParser`, `about`, `decode`).

Differential: the same bytes, cut into the same chunks, through both; every entry, cursor,
count and leftover must be equal and neither may raise, whatever the bytes (entries as
journalctl writes them, binary fields, absurd lengths, entries cut anywhere, garbage).
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_supervisor.journal import export
from vllm_supervisor.journal.export import LIFECYCLE_FIELDS, ExportDecoder
from vllm_supervisor.journal.writer import EntryFactory

EXPORT_BUILT = export.native_export_available()
NAMES = [
    b"__CURSOR",
    b"__REALTIME_TIMESTAMP",
    b"MESSAGE",
    b"MESSAGE_ID",
    b"PRIORITY",
    b"_PID",
    b"_UID",
    b"_SYSTEMD_UNIT",
    b"_SYSTEMD_INVOCATION_ID",
    b"UNIT",
    b"INVOCATION_ID",
    b"OBJECT_SYSTEMD_UNIT",
    b"_MACHINE_ID",
    b"_HOSTNAME",
    b"_BOOT_ID",
    b"_COMM",
    b"",
    *LIFECYCLE_FIELDS,
]
UNITS = frozenset({b"vllm.service", b"b.service"})


def _text_field(name: bytes, value: bytes) -> bytes:
    return name + b"=" + value + b"\n"


def _binary_field(name: bytes, value: bytes, length: int | None, separator: bytes) -> bytes:
    size = len(value) if length is None else length
    return name + b"\n" + size.to_bytes(8, "little") + value + separator


_value = st.one_of(
    st.sampled_from(
        [b"", b"1", b"0", b"4242", b" 7", b"-3", b"1_0", b"9" * 25, b"vllm.service",
         b"b.service", b"s=1;i=1", b"exit-code", b"bar\r50%\r", "ünï".encode(), b"\xff\xfe"]
    ),
    st.binary(max_size=24).map(lambda b: b.replace(b"\n", b"?")),
)  # fmt: skip
_field = st.one_of(
    st.builds(_text_field, st.sampled_from(NAMES), _value),
    st.builds(
        _binary_field,
        st.sampled_from(NAMES),
        st.binary(max_size=24),
        st.one_of(st.none(), st.sampled_from([0, 3, 1 << 30, 1 << 62, (1 << 64) - 1])),
        st.sampled_from([b"\n", b"x", b""]),
    ),
)
_entry = st.lists(_field, max_size=10).map(lambda fields: b"".join(fields) + b"\n")
# Entries that look like journald's: a cursor, a few of the fields decoding reads.
_likely = st.dictionaries(
    st.sampled_from(NAMES[1:]), st.sampled_from([b"", b"0", b"1", b"vllm.service", b"x\ny"])
).map(
    lambda fields: (
        b"__CURSOR=s=1\n"
        + b"".join(
            _binary_field(k, v, None, b"\n") if b"\n" in v else _text_field(k, v)
            for k, v in fields.items()
        )
        + b"\n"
    )
)
_stream = st.lists(
    st.one_of(_entry, _likely, st.binary(max_size=30), st.sampled_from([b"\n", b"\n\n", b"=\n\n"])),
    max_size=10,
).map(b"".join)


def _run(
    stream: bytes, cuts: list[int], native: bool, units: frozenset[bytes], max_chars: int
) -> tuple[object, ...]:
    decoder = ExportDecoder(max_chars, units, native=native, max_value_bytes=64)
    results = []
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    for start, end in itertools.pairwise(points):
        results.append(decoder.feed(stream[start:end]))
    return tuple(results), decoder.invalid, decoder.parsed, decoder.pending


@settings(max_examples=600, deadline=None)
@given(
    _stream,
    st.lists(st.integers(min_value=0, max_value=2000), max_size=6),
    st.sampled_from([frozenset(), UNITS]),
    st.sampled_from([4, 16384]),
)
def test_the_c_parser_agrees_with_the_python_path(
    stream: bytes, cuts: list[int], units: frozenset[bytes], max_chars: int
) -> None:
    """Any bytes, cut anywhere, through both: the same entries, cursors, counts and rest."""
    assert EXPORT_BUILT, "the export parser was not built (setup.py builds it with any C compiler)"
    assert _run(stream, cuts, True, units, max_chars) == _run(stream, cuts, False, units, max_chars)


def test_a_journal_s_entries_parse_the_same() -> None:
    """Entries as journalctl writes them (trusted fields, a binary message, PID 1's lifecycle
    message about the unit, another unit's line) give the same entries through both."""
    factory = EntryFactory()
    stream = b"".join(
        factory.entry(fields)
        for fields in (
            {"MESSAGE": "RuntimeError: boom", "_SYSTEMD_UNIT": "vllm.service", "_PID": "42"},
            {"MESSAGE": b"bar 10%\rbar 20%\r", "_SYSTEMD_UNIT": "vllm.service", "_PID": "42"},
            {"MESSAGE": "other", "_SYSTEMD_UNIT": "cron.service", "_PID": "7"},
            {
                "MESSAGE": "vllm.service: Main process exited, code=exited, status=1/FAILURE",
                "MESSAGE_ID": "98e322203f7a4ed290d09fe03c09fe15",
                "_PID": "1",
                "_SYSTEMD_UNIT": "init.scope",
                "UNIT": "vllm.service",
                "INVOCATION_ID": "a" * 32,
                "EXIT_CODE": "exited",
                "EXIT_STATUS": "1",
            },
        )
    )
    units = frozenset({b"vllm.service"})
    native = ExportDecoder(units=units, native=True).feed(stream)
    python = ExportDecoder(units=units, native=False).feed(stream)
    assert native == python
    entries = native[0]
    assert [e.message for e in entries] == [
        "RuntimeError: boom",
        "bar 20%",
        "vllm.service: Main process exited, code=exited, status=1/FAILURE",
    ]
    assert entries[2].unit == "vllm.service"
    assert dict(entries[2].fields) == {"EXIT_CODE": "exited", "EXIT_STATUS": "1"}
