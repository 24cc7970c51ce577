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

from ..util import sockdiag

JOURNAL_STDOUT = "/run/systemd/journal/stdout"

_UDIAG_SHOW_NAME = 0x1
_UNIX_DIAG_NAME = 0
_UNIX_DIAG_SHUTDOWN = 6
_BOTH_WAYS = 3  # RCV_SHUTDOWN | SEND_SHUTDOWN
_REQUEST = struct.Struct("=BBHIIIII")  # unix_diag_req: family, protocol, pad, states, ino,
#                                        show, cookie[2]
_MESSAGE = struct.Struct("=BBBBI")  # unix_diag_msg: family, type, state, pad, ino (+ cookie)
_MESSAGE_SIZE = 16


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
    every_state, no_cookie = 0xFFFFFFFF, 0xFFFFFFFF
    request = _REQUEST.pack(
        socket.AF_UNIX, 0, 0, every_state, 0, _UDIAG_SHOW_NAME, no_cookie, no_cookie
    )
    listening, alive, dying = False, 0, 0
    wanted = path.encode()
    for data in sockdiag.dump(request):
        sockets, _ = _sockets(data)
        for state, name, shutdown in sockets:
            if name != wanted:
                continue
            if state == sockdiag.TCP_LISTEN:
                listening = True
            elif state == sockdiag.TCP_ESTABLISHED:
                if shutdown == _BOTH_WAYS:
                    dying += 1
                else:
                    alive += 1
    return StreamCount(listening=listening, open=alive, dying=dying)


def _sockets(data: bytes) -> tuple[list[tuple[int, bytes | None, int | None]], bool]:
    """(state, bound name, shutdown) of each socket the datagram describes, and whether it ends
    the dump."""
    found: list[tuple[int, bytes | None, int | None]] = []
    done = False
    for kind, payload in sockdiag.messages(data):
        done = done or sockdiag.is_done(kind)
        if kind != sockdiag.SOCK_DIAG_BY_FAMILY or len(payload) < _MESSAGE_SIZE:
            continue
        _, _, state, _, _ = _MESSAGE.unpack_from(payload)
        name: bytes | None = None
        shutdown: int | None = None
        for attribute, value in sockdiag.attributes(payload, _MESSAGE_SIZE):
            if attribute == _UNIX_DIAG_NAME:
                name = value.rstrip(b"\0")
            elif attribute == _UNIX_DIAG_SHUTDOWN and value:
                shutdown = value[0]
        found.append((state, name, shutdown))
    return found, done
