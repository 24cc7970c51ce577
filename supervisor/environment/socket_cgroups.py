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

from ..util import sockdiag

CGROUP_FS = Path("/sys/fs/cgroup")
_INET_DIAG_CGROUP_ID = 21
_REQUEST = struct.Struct("=BBBBI48x")  # inet_diag_req_v2: family, protocol, ext, pad, states, id
_PORT = struct.Struct(">H")  # inet_diag_sockid's sport, first in the id, network order
_INODE = struct.Struct("=I")  # inet_diag_msg's inode, after expires, rqueue, wqueue and uid
_INODE_AT = 68
_MESSAGE_SIZE = 72
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
    request = _REQUEST.pack(family, socket.IPPROTO_TCP, 0, 0, 1 << sockdiag.TCP_LISTEN)
    sockets: list[DiagSocket] = []
    for data in sockdiag.dump(request):
        sockets.extend(parse_dump(data)[0])
    return sockets


def parse_dump(data: bytes) -> tuple[list[DiagSocket], bool]:
    """The listening sockets one sock_diag datagram describes, and whether it ends the dump;
    OSError for an error message or a message cut short."""
    found: list[DiagSocket] = []
    done = False
    for kind, payload in sockdiag.messages(data):
        done = done or sockdiag.is_done(kind)
        if kind == sockdiag.SOCK_DIAG_BY_FAMILY and len(payload) >= _MESSAGE_SIZE:
            (port,) = _PORT.unpack_from(payload, 4)
            (inode,) = _INODE.unpack_from(payload, _INODE_AT)
            found.append(DiagSocket(port, inode, _cgroup_id(payload)))
    return found, done


def _cgroup_id(payload: bytes) -> int | None:
    for attribute, value in sockdiag.attributes(payload, _MESSAGE_SIZE):
        if attribute == _INET_DIAG_CGROUP_ID and len(value) >= _CGROUP_ID.size:
            return int(_CGROUP_ID.unpack_from(value)[0])
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
