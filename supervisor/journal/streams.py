"""Has journald written every line of the processes that died? Asked of the kernel, not guessed.

A service's stdout reaches journald through a stream socket, PID 1's "Main process exited" through
another socket, and journald reads them in no fixed order: on systemd 252 about half of the seed
crash's runs had most of their 206 lines written *after* PID 1's end messages (up to 2.4 ms
later, up to 192 lines; measured in nspawn). A crash decided on what was read by then misses its
cause, so the tracker waits for late lines (`settle_s`). This module says when the wait is over.

When the last process holding a stream's client end exits, the kernel marks journald's end of
the socket shut down in both directions (`sk_shutdown` = 3; a live stream shows 2, journald
having shut its own write side). journald reads what is left, sees end of file, writes the last
lines and closes the socket. So: once no socket named `/run/systemd/journal/stdout` is left in
that half-dead state, every line of every dead process is in the journal files. The kernel's
sock_diag netlink interface lists the sockets with their shutdown state to any user (`ss -x`
does the same), inside the daemon's sandbox too (`AF_NETLINK` in RestrictAddressFamilies=).

Unix sockets belong to a network namespace: a daemon in another one than journald's sees none,
which would look drained. So the answer counts only once the listening socket itself was seen.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

JOURNAL_STDOUT = "/run/systemd/journal/stdout"

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 0x1
_NLM_F_DUMP = 0x300
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_UDIAG_SHOW_NAME = 0x1
_UNIX_DIAG_NAME = 0
_UNIX_DIAG_SHUTDOWN = 6
_TCP_ESTABLISHED = 1
_TCP_LISTEN = 10
_BOTH_WAYS = 3  # RCV_SHUTDOWN | SEND_SHUTDOWN
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_REQUEST = struct.Struct("=BBHIIIII")  # unix_diag_req: family, protocol, pad, states, ino,
#                                        show, cookie[2]
_MESSAGE = struct.Struct("=BBBBI")  # unix_diag_msg: family, type, state, pad, ino (+ cookie)
_MESSAGE_SIZE = 16
_ATTRIBUTE = struct.Struct("=HH")  # nlattr: len, type


@dataclass(frozen=True, slots=True)
class StreamCount:
    """journald's stdout stream sockets, as the kernel lists them."""

    listening: bool  # the socket services connect to was seen (same network namespace)
    open: int  # streams whose writers are alive
    dying: int  # streams whose writers are gone, not yet read to their end by journald

    @property
    def drained(self) -> bool:
        """Every line of every dead writer is written (and this namespace can tell)."""
        return self.listening and self.dying == 0


def count_streams(path: str = JOURNAL_STDOUT) -> StreamCount:
    """Ask the kernel for the stream sockets bound to `path`; OSError when it cannot say."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as diag:
        every_state, no_cookie = 0xFFFFFFFF, 0xFFFFFFFF
        request = _REQUEST.pack(
            socket.AF_UNIX, 0, 0, every_state, 0, _UDIAG_SHOW_NAME, no_cookie, no_cookie
        )
        header = _HEADER.pack(
            _HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0
        )
        diag.sendto(header + request, (0, 0))
        listening, alive, dying = False, 0, 0
        wanted = path.encode()
        while True:
            data = diag.recv(1 << 16)
            if not data:
                raise OSError("sock_diag: the kernel closed the dump")
            sockets, done = _sockets(data)
            for state, name, shutdown in sockets:
                if name != wanted:
                    continue
                if state == _TCP_LISTEN:
                    listening = True
                elif state == _TCP_ESTABLISHED:
                    if shutdown == _BOTH_WAYS:
                        dying += 1
                    else:
                        alive += 1
            if done:
                return StreamCount(listening=listening, open=alive, dying=dying)


def _messages(data: bytes) -> list[tuple[int, bytes]]:
    """The netlink messages of one datagram: (type, payload)."""
    found = []
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, kind, _, _, _ = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size or offset + length > len(data):
            raise OSError("sock_diag: a truncated netlink message")
        found.append((kind, data[offset + _HEADER.size : offset + length]))
        offset += (length + 3) & ~3
    return found


def _sockets(data: bytes) -> tuple[list[tuple[int, bytes | None, int | None]], bool]:
    """(state, bound name, shutdown) of each socket the datagram describes, and whether it ends
    the dump."""
    found: list[tuple[int, bytes | None, int | None]] = []
    done = False
    for kind, payload in _messages(data):
        done = done or kind == _NLMSG_DONE
        if kind == _NLMSG_ERROR:
            (errno,) = struct.unpack_from("=i", payload) if len(payload) >= 4 else (0,)
            raise OSError(-errno, "sock_diag refused the dump")
        if kind != _SOCK_DIAG_BY_FAMILY or len(payload) < _MESSAGE_SIZE:
            continue
        _, _, state, _, _ = _MESSAGE.unpack_from(payload)
        name: bytes | None = None
        shutdown: int | None = None
        offset = _MESSAGE_SIZE
        while offset + _ATTRIBUTE.size <= len(payload):
            length, attribute = _ATTRIBUTE.unpack_from(payload, offset)
            if length < _ATTRIBUTE.size:
                break
            value = payload[offset + _ATTRIBUTE.size : offset + length]
            if attribute == _UNIX_DIAG_NAME:
                name = value.rstrip(b"\0")
            elif attribute == _UNIX_DIAG_SHUTDOWN and value:
                shutdown = value[0]
            offset += (length + 3) & ~3
        found.append((state, name, shutdown))
    return found, done
