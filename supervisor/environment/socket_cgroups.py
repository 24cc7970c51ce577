"""Which cgroup opened a listening TCP socket: asked of the kernel, readable by any user.

Another user's open files are closed to the daemon's user, so /proc/*/fd cannot say which
process holds a port. The kernel's sock_diag netlink interface (`ss -ltn --cgroup`) can: since
Linux 5.9 it reports, for every socket, the id of the cgroup v2 its creator ran in. That id is
the inode number of the cgroup's directory under the cgroup2 mount (/sys/fs/cgroup, or
/sys/fs/cgroup/unified on a hybrid host), whose path names the systemd unit and whose
cgroup.procs lists the unit's processes. Both are readable inside the daemon's sandbox.

A host that runs cgroup v1 only keeps every process in the v2 root: its id names no unit.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 0x1
_NLM_F_DUMP = 0x300
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_TCP_LISTEN = 10
_INET_DIAG_CGROUP_ID = 21
_HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_REQUEST = struct.Struct("=BBBBI48x")  # inet_diag_req_v2: family, protocol, ext, pad, states, id
_PORT = struct.Struct(">H")  # inet_diag_sockid's sport, first in the id, network order
_INODE = struct.Struct("=I")  # inet_diag_msg's inode, after expires, rqueue, wqueue and uid
_INODE_AT = 68
_MESSAGE_SIZE = 72
_ATTRIBUTE = struct.Struct("=HH")  # nlattr: len, type
_CGROUP_ID = struct.Struct("=Q")
_MAX_CGROUPS = 100_000  # a walk of /sys/fs/cgroup stops here (hosts have hundreds)


@dataclass(frozen=True, slots=True)
class DiagSocket:
    """A listening TCP socket as sock_diag reports it."""

    port: int
    inode: int
    cgroup_id: int | None


def listening_cgroups(port: int) -> dict[int, int]:
    """{socket inode: cgroup id} of the TCP sockets listening on `port` (IPv4 and IPv6);
    OSError when the kernel cannot be asked."""
    found: dict[int, int] = {}
    for family in (socket.AF_INET, socket.AF_INET6):
        for diag in _dump(family):
            if diag.port == port and diag.cgroup_id is not None and diag.inode:
                found[diag.inode] = diag.cgroup_id
    return found


def _dump(family: int) -> list[DiagSocket]:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as diag:
        request = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_LISTEN)
        flags = _NLM_F_REQUEST | _NLM_F_DUMP
        header = _HEADER.pack(_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, flags, 1, 0)
        diag.sendto(header + request, (0, 0))
        sockets: list[DiagSocket] = []
        while True:
            data = diag.recv(1 << 16)
            if not data:
                raise OSError("sock_diag: the kernel closed the dump")
            more, done = parse_dump(data)
            sockets.extend(more)
            if done:
                return sockets


def parse_dump(data: bytes) -> tuple[list[DiagSocket], bool]:
    """The listening sockets one sock_diag datagram describes, and whether it ends the dump;
    OSError for an error message or a message cut short."""
    found: list[DiagSocket] = []
    done = False
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, kind, _, _, _ = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size or offset + length > len(data):
            raise OSError("sock_diag: a truncated netlink message")
        payload = data[offset + _HEADER.size : offset + length]
        offset += (length + 3) & ~3
        if kind == _NLMSG_DONE:
            done = True
        elif kind == _NLMSG_ERROR:
            (errno,) = struct.unpack_from("=i", payload) if len(payload) >= 4 else (0,)
            raise OSError(-errno, "sock_diag refused the dump")
        elif kind == _SOCK_DIAG_BY_FAMILY and len(payload) >= _MESSAGE_SIZE:
            (port,) = _PORT.unpack_from(payload, 4)
            (inode,) = _INODE.unpack_from(payload, _INODE_AT)
            found.append(DiagSocket(port, inode, _cgroup_id(payload)))
    return found, done


def _cgroup_id(payload: bytes) -> int | None:
    offset = _MESSAGE_SIZE
    while offset + _ATTRIBUTE.size <= len(payload):
        length, attribute = _ATTRIBUTE.unpack_from(payload, offset)
        if length < _ATTRIBUTE.size:
            return None
        if attribute == _INET_DIAG_CGROUP_ID and length >= _ATTRIBUTE.size + _CGROUP_ID.size:
            return int(_CGROUP_ID.unpack_from(payload, offset + _ATTRIBUTE.size)[0])
        offset += (length + 3) & ~3
    return None


def cgroup2_mount(cgroup_fs: Path = CGROUP_FS) -> Path | None:
    """Where the cgroup v2 hierarchy is mounted: the unified host's /sys/fs/cgroup, a hybrid
    host's /sys/fs/cgroup/unified; None on a cgroup v1 host."""
    for candidate in (cgroup_fs / "unified", cgroup_fs):
        if (candidate / "cgroup.controllers").is_file():
            return candidate
    return None


def cgroup_path(mount: Path, cgroup_id: int) -> str | None:
    """The path under `mount` ("/system.slice/x.service") of the cgroup with this id, or None
    when no cgroup below the root has it (the root itself names no unit)."""
    pending = [mount]
    seen = 0
    while pending and seen < _MAX_CGROUPS:
        directory = pending.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            try:
                if not entry.is_dir(follow_symlinks=False):
                    continue
                if entry.inode() == cgroup_id:
                    return "/" + Path(entry.path).relative_to(mount).as_posix()
            except OSError:
                continue
            pending.append(Path(entry.path))
    return None


def cgroup_pids(mount: Path, path: str) -> list[int]:
    """The processes in the cgroup at `path` (its cgroup.procs); [] when it cannot be read."""
    try:
        text = (mount / path.lstrip("/") / "cgroup.procs").read_text(errors="replace")
    except OSError:
        return []
    return [int(word) for word in text.split() if word.isascii() and word.isdigit()]
