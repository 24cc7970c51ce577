"""The rows' C parser (`journal/_rows.c`) does exactly what `LineParser`'s Python loop does.

Differential: the same bytes, cut into the same chunks, through both; every entry, cursor,
count and leftover must be equal, whatever the bytes (rows the child writes, rows cut anywhere,
garbage, sync answers, cursor-only records).
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_supervisor.journal import export
from vllm_supervisor.journal.export import LINE_FIELDS, LineParser

ROWS_BUILT = export.native_rows_available()


def _row(values: list[bytes], message: bytes, cursor: bytes, realtime: bytes) -> bytes:
    return (
        b"\t".join([cursor, realtime, *values, str(len(message)).encode()])
        + b"\n"
        + message
        + b"\n"
    )


_value = st.one_of(
    st.just(b""),
    st.sampled_from([b"1", b"0", b"4242", b"vllm.service", b"6", b"3", b"a" * 32, b"exit-code"]),
    st.binary(max_size=12).map(lambda b: b.replace(b"\t", b"?").replace(b"\n", b"?")),
)
_message = st.one_of(
    st.binary(max_size=80),
    st.sampled_from([b"plain line", b"bar\r50%\r100%", b"nul\x00byte", "ünïcode".encode()]),
)
_good_row = st.builds(
    _row,
    st.lists(_value, min_size=len(LINE_FIELDS), max_size=len(LINE_FIELDS)),
    _message,
    st.sampled_from([b"s=1;i=1", b"s=1;i=2", b"", "c\u00e9".encode()]),
    st.sampled_from([b"1796116530436524", b"", b"12x", b"9" * 25]),
)
_other = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"#7\n", b"#123456789012345678901234\n", b"#x\n", b"s=9;i=9\n", b"\n"]),
)
_stream = st.lists(st.one_of(_good_row, _other), max_size=12).map(b"".join)


def _run(stream: bytes, cuts: list[int], native: bool, max_chars: int) -> tuple[object, ...]:
    parser = LineParser(max_chars, native=native)
    results = []
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    for start, end in itertools.pairwise(points):
        results.append(parser.feed(stream[start:end]))
    return tuple(results), parser.invalid, parser.synced, parser._buffer


@settings(max_examples=400, deadline=None)
@given(
    _stream,
    st.lists(st.integers(min_value=0, max_value=2000), max_size=6),
    st.sampled_from([8, 16384]),
)
def test_the_c_parser_agrees_with_the_python_loop(
    stream: bytes, cuts: list[int], max_chars: int
) -> None:
    assert ROWS_BUILT, "the rows' parser was not built (setup.py builds it with any C compiler)"
    assert _run(stream, cuts, True, max_chars) == _run(stream, cuts, False, max_chars)


def test_a_real_row_parses_the_same() -> None:
    """One row as the native child writes it, through both parsers."""
    values = [b""] * len(LINE_FIELDS)
    values[2], values[3], values[4] = b"4242", b"vllm.service", b"a" * 32
    message = b"RuntimeError: flashinfer-cubin version"
    stream = _row(values, message, b"s=1;i=1", b"1796116530436524")
    native, python = LineParser(native=True).feed(stream), LineParser(native=False).feed(stream)
    assert native == python
    assert native[0][0].message == "RuntimeError: flashinfer-cubin version"
    assert native[0][0].pid == 4242
