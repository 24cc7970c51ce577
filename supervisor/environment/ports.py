"""Who holds a TCP port now: the listening socket in /proc/net/tcp{,6}, its process in /proc.

A server that cannot bind its port ("Address already in use") restarts into the same error
for as long as the holder lives. Whether a restart can work depends on who that is: the
crashed server's own child still exiting (it goes with the unit's cgroup), or a process of
another unit or of nobody's (an orphaned server, a manual run), which outlives every restart.

The socket table is readable by every user; a process's open files only by its own user
(or root): under the daemon's hardened unit the holder's PID may be invisible, and the
listening socket's uid is all it can name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column
_SOCKET_LINK = re.compile(r"socket:\[(\d+)\]")
_UNIT = re.compile(r"/([^/]+\.(?:service|scope))(?:/|$)")
_MAX_COMMAND = 300


@dataclass(frozen=True, slots=True)
class Listener:
    """A listening TCP socket of /proc/net/tcp or tcp6."""

    port: int
    uid: int
    inode: int


@dataclass(frozen=True, slots=True)
class Holder:
    """A process that holds a listening socket of the port (pid None: not visible to us)."""

    port: int
    uid: int
    inode: int  # the listening socket: the same inode at two crashes is the same holder
    pid: int | None = None
    command: str | None = None
    unit: str | None = None  # its systemd unit, from /proc/PID/cgroup
    started: float | None = None  # when the process started (epoch seconds)

    def describe(self) -> str:
        """In words, e.g. `PID 4242 (python3 -m http.server 8000) of blocker.service`."""
        if self.pid is None:
            return f"a process of uid {self.uid} (its PID is not visible to this daemon)"
        what = f"PID {self.pid}"
        if self.command:
            what += f" ({self.command})"
        return what + (f" of {self.unit}" if self.unit else ", in no unit")


def parse_listeners(text: str) -> list[Listener]:
    """The LISTEN sockets of one /proc/net/tcp{,6} text; malformed lines are skipped."""
    found = []
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != _LISTEN:
            continue
        _, _, port_hex = fields[1].rpartition(":")
        try:
            found.append(Listener(int(port_hex, 16), int(fields[7]), int(fields[9])))
        except ValueError:
            continue
    return found


def unit_of_cgroup(text: str) -> str | None:
    """The systemd unit of a /proc/PID/cgroup text (v2 `0::/...`, or v1's name=systemd)."""
    paths = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and (parts[0] == "0" or parts[1] == "name=systemd"):
            paths.append(parts[2])
    for path in paths:
        units = _UNIT.findall(path)
        if units:
            return str(units[-1])
    return None


def listeners(port: int, proc: Path = PROC) -> list[Listener]:
    """The sockets listening on `port` (any address, IPv4 and IPv6)."""
    found: list[Listener] = []
    for name in ("tcp", "tcp6"):
        try:
            text = (proc / "net" / name).read_text(encoding="ascii", errors="replace")
        except OSError:
            continue
        found.extend(s for s in parse_listeners(text) if s.port == port)
    return found


def holders(port: int, proc: Path = PROC) -> list[Holder]:
    """The processes holding a listening socket of `port`, one per (socket, process)."""
    sockets = {s.inode: s for s in listeners(port, proc) if s.inode}
    if not sockets:
        return []
    found: list[Holder] = []
    seen: set[int] = set()
    for pid, inode in _socket_owners(proc, set(sockets)):
        seen.add(inode)
        found.append(
            Holder(
                port=port,
                uid=sockets[inode].uid,
                inode=inode,
                pid=pid,
                command=_command(proc, pid),
                unit=_unit(proc, pid),
                started=_started(proc, pid),
            )
        )
    found.extend(Holder(port=port, uid=s.uid, inode=i) for i, s in sockets.items() if i not in seen)
    return found


def _socket_owners(proc: Path, inodes: set[int]) -> Iterator[tuple[int, int]]:
    """(pid, inode) for each process with one of `inodes` open; others' fds are skipped."""
    try:
        pids = [p for p in proc.iterdir() if p.name.isascii() and p.name.isdigit()]
    except OSError:
        return
    for pid in pids:
        try:
            fds = list((pid / "fd").iterdir())
        except OSError:  # another user's process, or gone
            continue
        for fd in fds:
            try:
                match = _SOCKET_LINK.fullmatch(str(fd.readlink()))
            except OSError:
                continue
            if match is not None and int(match.group(1)) in inodes:
                yield int(pid.name), int(match.group(1))


def _command(proc: Path, pid: int) -> str | None:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    command = " ".join(raw.replace(b"\0", b" ").decode("utf-8", "replace").split())
    return command[:_MAX_COMMAND] or None


def _unit(proc: Path, pid: int) -> str | None:
    try:
        return unit_of_cgroup((proc / str(pid) / "cgroup").read_text(errors="replace"))
    except OSError:
        return None


def _started(proc: Path, pid: int) -> float | None:
    """The process's start (epoch seconds): /proc/PID/stat's starttime after /proc/stat's btime."""
    try:
        stat = (proc / str(pid) / "stat").read_text(errors="replace")
        boot = (proc / "stat").read_text(errors="replace")
    except OSError:
        return None
    return process_start(stat, boot, os.sysconf("SC_CLK_TCK"))


def process_start(stat: str, boot: str, ticks_per_s: int) -> float | None:
    """Epoch seconds of a process's start from its stat line and the system's /proc/stat."""
    _, _, after_comm = stat.rpartition(")")  # the command may hold spaces and parentheses
    fields = after_comm.split()
    btime = None
    for words in map(str.split, boot.splitlines()):
        if len(words) == 2 and words[0] == "btime":
            btime = words[1]
    if len(fields) < 20 or btime is None or ticks_per_s <= 0:
        return None
    try:
        return int(btime) + int(fields[19]) / ticks_per_s
    except ValueError:
        return None
