"""The kernel's sock_diag netlink dump: one request, then datagrams of messages, to any user.

Shared by the journald stream probe (unix sockets, journal.streams) and the port holder's
cgroup (TCP listeners, environment.socket_cgroups); each reads its own message layout.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
TCP_ESTABLISHED = 1
TCP_LISTEN = 10
_NLM_F_REQUEST = 0x1
_NLM_F_DUMP = 0x300
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_ATTRIBUTE = struct.Struct("=HH")  # nlattr: len, type


def dump(request: bytes) -> Iterator[bytes]:
    """Send one sock_diag dump `request` (the family's request struct); yield each datagram
    until the dump is done. OSError when the kernel refuses or closes it."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_SOCK_DIAG) as diag:
        flags = _NLM_F_REQUEST | _NLM_F_DUMP
        header = _HEADER.pack(_HEADER.size + len(request), SOCK_DIAG_BY_FAMILY, flags, 1, 0)
        diag.sendto(header + request, (0, 0))
        while True:
            data = diag.recv(1 << 16)
            if not data:
                raise OSError("sock_diag: the kernel closed the dump")
            yield data
            if any(kind == _NLMSG_DONE for kind, _ in messages(data)):
                return


def messages(data: bytes) -> list[tuple[int, bytes]]:
    """The netlink messages of one datagram: (type, payload). OSError for one cut short or
    for the kernel's error message."""
    found = []
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, kind, _, _, _ = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size or offset + length > len(data):
            raise OSError("sock_diag: a truncated netlink message")
        payload = data[offset + _HEADER.size : offset + length]
        if kind == _NLMSG_ERROR:
            (errno,) = struct.unpack_from("=i", payload) if len(payload) >= 4 else (0,)
            raise OSError(-errno, "sock_diag refused the dump")
        found.append((kind, payload))
        offset += (length + 3) & ~3
    return found


def is_done(kind: int) -> bool:
    """The message that ends a dump."""
    return kind == _NLMSG_DONE


def attributes(payload: bytes, offset: int) -> Iterator[tuple[int, bytes]]:
    """The netlink attributes (type, value) after a message's fixed part, at `offset`."""
    while offset + _ATTRIBUTE.size <= len(payload):
        length, attribute = _ATTRIBUTE.unpack_from(payload, offset)
        if length < _ATTRIBUTE.size:
            return
        yield attribute, payload[offset + _ATTRIBUTE.size : offset + length]
        offset += (length + 3) & ~3
