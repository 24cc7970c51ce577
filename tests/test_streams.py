"""journald's dead streams, as the kernel lists them: real unix sockets on loopback paths."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.journal.streams import _sockets, count_streams


class TestCountStreams:
    def test_a_stream_is_open_then_dying_then_gone(self, tmp_path: Path) -> None:
        """journald's end of a stream: open while its writer lives, dying once the writer
        exited and until journald closes it, gone after."""
        path = str(tmp_path / "stdout")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
            server.bind(path)
            server.listen()
            assert count_streams(path).drained
            writer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            writer.connect(path)
            journald_end, _ = server.accept()
            journald_end.shutdown(socket.SHUT_WR)  # journald never writes to a stream
            writer.sendall(b"the last line before the crash\n")
            counted = count_streams(path)
            assert (counted.listening, counted.open, counted.dying) == (True, 1, 0)
            writer.close()  # the service died
            counted = count_streams(path)
            assert (counted.open, counted.dying, counted.drained) == (0, 1, False)
            assert journald_end.recv(100) == b"the last line before the crash\n"
            assert journald_end.recv(100) == b""  # end of file: journald closes the stream
            journald_end.close()
            assert count_streams(path).drained

    def test_nothing_listening_is_not_drained(self, tmp_path: Path) -> None:
        """Another network namespace (or no journald) sees no socket at all: that is not
        evidence that every line was written."""
        counted = count_streams(str(tmp_path / "nobody-listens"))
        assert not counted.listening
        assert not counted.drained


@given(st.binary(max_size=400))
def test_any_reply_parses_or_raises_oserror(data: bytes) -> None:
    """A reply the kernel never sends (truncated, garbage) is an OSError, never a crash."""
    with contextlib.suppress(OSError):
        _sockets(data)
