"""The daemon's own log as native journal entries (supervisor.telemetry.journald).

A real AF_UNIX datagram socket stands in for journald's: what arrives is parsed by this test's
own reading of the Native Journal Protocol, independent of the encoder.
"""

from __future__ import annotations

import io
import json
import os
import re
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.telemetry.journald import (
    MESSAGE_IDS,
    JournalLogger,
    JournalLoggerFactory,
    as_event,
    encode,
    entry,
    under_journald,
)

REPO = Path(__file__).resolve().parent.parent
CATALOG = REPO / "deploy" / "catalog" / "vllm-supervisor.catalog"


def parse(datagram: bytes) -> dict[str, str]:
    """The fields of one native-protocol datagram."""
    fields, at = {}, 0
    while at < len(datagram):
        line_end = datagram.index(b"\n", at)
        line = datagram[at:line_end]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            at = line_end + 1
        else:
            key = line
            (size,) = struct.unpack("<Q", datagram[line_end + 1 : line_end + 9])
            value = datagram[line_end + 9 : line_end + 9 + size]
            assert datagram[line_end + 9 + size : line_end + 10 + size] == b"\n"
            at = line_end + 10 + size
        assert re.fullmatch(rb"[A-Z0-9_]+", key), key
        fields[key.decode()] = value.decode()
    return fields


@pytest.fixture
def journald(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(tmp_path / "socket")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(path)
    server.settimeout(5)
    yield path, server
    server.close()


def test_a_halt_is_a_warning_with_its_message_id_and_fields(journald) -> None:
    """Through structlog as the daemon configures it: PRIORITY 4, the halt's MESSAGE_ID, the
    unit and signature as fields, a readable MESSAGE and the whole event."""
    path, server = journald
    structlog.configure(
        processors=[structlog.processors.add_log_level, as_event],
        logger_factory=JournalLoggerFactory(path),
    )
    try:
        structlog.get_logger().warning(
            "unit_halted",
            unit="vllm.service",
            invocation_id="abc",
            signature="flashinfer_cubin_mismatch",
            severity="fatal",
            root_cause="RuntimeError: flashinfer-cubin version (0.6.3) does not match",
            restarts=3,
        )
        fields = parse(server.recv(65536))
    finally:
        structlog.reset_defaults()
    assert fields["PRIORITY"] == "4"
    assert fields["MESSAGE_ID"] == MESSAGE_IDS["unit_halted"]
    assert fields["SUPERVISED_UNIT"] == "vllm.service"
    assert fields["SUPERVISED_INVOCATION_ID"] == "abc"
    assert fields["SIGNATURE"] == "flashinfer_cubin_mismatch"
    assert fields["SYSLOG_IDENTIFIER"] == "vllm-supervisor"
    assert fields["MESSAGE"].startswith("unit_halted unit=vllm.service signature=flashinfer")
    assert json.loads(fields["EVENT_JSON"])["restarts"] == 3


def test_an_error_is_priority_3_and_info_6(journald) -> None:
    """Levels map to syslog priorities, so `journalctl -p warning` shows failures only."""
    path, server = journald
    logger = JournalLogger(path)
    logger.msg({"event": "halt_failed", "level": "error", "unit": "u"})
    logger.msg({"event": "following_journal", "level": "info"})
    first, second = parse(server.recv(65536)), parse(server.recv(65536))
    assert (first["PRIORITY"], first["MESSAGE_ID"]) == ("3", MESSAGE_IDS["halt_failed"])
    assert second["PRIORITY"] == "6" and "MESSAGE_ID" not in second


def test_a_refused_datagram_falls_back_to_the_json_line(tmp_path: Path) -> None:
    """No journald at the path: the event is written to the stream instead, not lost."""
    stream = io.StringIO()
    JournalLogger(str(tmp_path / "none"), fallback=stream).msg({"event": "x", "level": "info"})
    assert json.loads(stream.getvalue())["event"] == "x"


def test_journal_stream_is_recognised_only_for_its_own_stream(tmp_path: Path) -> None:
    """JOURNAL_STREAM names stderr's device:inode; an inherited value for another file does not
    count (a child whose stderr was redirected)."""
    with (tmp_path / "f").open("w") as handle, (tmp_path / "g").open("w") as other:
        info = os.fstat(handle.fileno())
        env = {"JOURNAL_STREAM": f"{info.st_dev}:{info.st_ino}"}
        assert under_journald(env, handle)
        assert not under_journald(env, other)
        assert not under_journald({}, handle)
        assert not under_journald({"JOURNAL_STREAM": "garbage"}, handle)


def test_every_message_id_is_explained_in_the_catalog() -> None:
    """`journalctl -x` explains each kind of event, and the catalog names no unknown id."""
    ids = re.findall(r"^-- ([0-9a-f]{32})$", CATALOG.read_text(), re.MULTILINE)
    assert sorted(ids) == sorted(MESSAGE_IDS.values())
    assert len(set(MESSAGE_IDS.values())) == len(MESSAGE_IDS)


VALUES = st.text() | st.integers() | st.none() | st.lists(st.text(max_size=5), max_size=3)


@given(
    event=st.dictionaries(st.text(min_size=1, max_size=15), VALUES, max_size=8),
    name=st.sampled_from([*MESSAGE_IDS, "other"]),
    level=st.sampled_from(["debug", "info", "warning", "error", "critical", "odd"]),
)
def test_any_event_encodes_and_reads_back(event: dict, name: str, level: str) -> None:
    """Any keys and values (newlines, NULs, surrogates) make a datagram that parses back to the
    same fields: the length-prefixed form carries what a line cannot."""
    fields = entry({**event, "event": name, "level": level})
    decoded = {k: v.encode("utf-8", "replace").decode() for k, v in fields.items()}
    assert parse(encode(fields)) == decoded
    assert fields["PRIORITY"] in {"2", "3", "4", "6", "7"}
