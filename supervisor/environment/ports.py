"""Who holds a TCP port now: the listening socket in /proc/net/tcp{,6}, its process in /proc.

A server that cannot bind its port ("Address already in use") restarts into the same error
for as long as the holder lives. Whether a restart can work depends on who that is: the
crashed server's own child still exiting (it goes with the unit's cgroup), or a process of
another unit or of nobody's (an orphaned server, a manual run), which outlives every restart.

The socket table is readable by every user; a process's open files only by its own user
(or root). Under the daemon's hardened unit (its own user, `PrivateUsers=yes`) another user's
holder is hidden twice: its open files are closed, and the socket table shows its uid as the
overflow uid 65534, which is nobody's. What is still known: the cgroup the socket was opened in
(sock_diag, supervisor.environment.socket_cgroups), so its unit and that unit's processes, and
a user slice's uid from its name; the unit's uid is systemd's to tell (D-Bus, the caller's).
A uid this namespace hides is None here, and said so, never 65534.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from .socket_cgroups import cgroup2_mount, cgroup_path, cgroup_pids, listening_cgroups
from .userns import IdMap, own_id_map, user_name

PROC = Path("/proc")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column
_SOCKET_LINK = re.compile(r"socket:\[(\d+)\]")
_UNIT = re.compile(r"/([^/]+\.(?:service|scope))(?:/|$)")
_USER_SLICE = re.compile(r"/user-([0-9]+)\.slice(?:/|$)")
_MAX_COMMAND = 300
_PIDS_NAMED = 5
HIDDEN_UID = "uid hidden by PrivateUsers="
# The signatures of a crash that could not bind its port: the server's own (the one preflight's
# port check predicts) and torch.distributed's rendezvous store's.
PORT_IN_USE = "port_in_use"
PORT_SIGNATURES = frozenset({PORT_IN_USE, "torch_distributed_port_in_use"})


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
    uid: int | None  # None: this daemon's user namespace hides it (PrivateUsers=)
    inode: int
    pid: int | None = None
    command: str | None = None
    unit: str | None = None  # its systemd unit, from /proc/PID/cgroup or the socket's cgroup
    started: float | None = None  # when the process started (epoch seconds)
    user: str | None = None  # the uid's name
    pids: tuple[int, ...] = ()  # pid None: the processes of the cgroup the socket came from

    def describe(self) -> str:
        """In words, e.g. `PID 4242 (python3 -m http.server 8000) of blocker.service (user
        www, uid 991)`; a uid the daemon cannot know is said to be hidden."""
        owner = self.owner()
        if self.pid is not None:
            what = f"PID {self.pid}" + (f" ({self.command})" if self.command else "")
            return f"{what} {f'of {self.unit}' if self.unit else 'in no unit'} ({owner})"
        if self.unit is not None:
            named = ", ".join(map(str, self.pids[:_PIDS_NAMED]))
            more = len(self.pids) - _PIDS_NAMED
            named += f" and {more} more" if more > 0 else ""
            return f"a process of {self.unit} ({f'PIDs {named}; ' if named else ''}{owner})"
        return f"a process ({owner}; its PID is not visible to this daemon)"

    def owner(self) -> str:
        """`user www, uid 991`, `uid 991`, or that the uid is hidden."""
        if self.uid is None:
            return HIDDEN_UID
        return f"user {self.user}, uid {self.uid}" if self.user else f"uid {self.uid}"


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


def holders(port: int, proc: Path = PROC, *, ids: IdMap | None = None) -> list[Holder]:
    """The processes holding a listening socket of `port`, one per (socket, process); a socket
    whose process is not visible is named by the cgroup it was opened in, where known."""
    sockets = {s.inode: s for s in listeners(port, proc) if s.inode}
    if not sockets:
        return []
    ids = ids if ids is not None else own_id_map(proc)
    found: list[Holder] = []
    seen: set[int] = set()
    for pid, inode in _socket_owners(proc, set(sockets)):
        seen.add(inode)
        cgroup = _cgroup(proc, pid)
        holder = Holder(
            port=port,
            uid=_visible_uid(sockets[inode].uid, ids),
            inode=inode,
            pid=pid,
            command=_command(proc, pid),
            unit=None if cgroup is None else unit_of_cgroup(cgroup),
            started=_started(proc, pid),
        )
        found.append(_named(holder, cgroup, ids))
    unseen = [s for i, s in sockets.items() if i not in seen]
    found.extend(_by_cgroup(port, unseen, proc, ids))
    return found


def with_unit_uid(holder: Holder, uid: int | None, ids: IdMap) -> Holder:
    """The holder with the uid systemd runs its unit as, where the socket's uid is hidden: only
    a uid that this namespace does not map fits (a mapped one would have shown), so a unit that
    changes users on its own keeps its uid hidden."""
    if holder.uid is not None or uid is None or ids.maps(uid):
        return holder
    return replace(holder, uid=uid, user=user_name(uid))


def uid_of_cgroup(path: str) -> int | None:
    """The uid in a cgroup path under a user slice (`/user.slice/user-991.slice/...`)."""
    found = _USER_SLICE.findall(path)
    return int(found[-1]) if found else None


def _visible_uid(seen: int, ids: IdMap) -> int | None:
    return None if ids.hides(seen) else seen


def _named(holder: Holder, cgroup: str | None, ids: IdMap) -> Holder:
    """The user's name; a hidden uid from its user slice, where the cgroup is one."""
    if holder.uid is None and cgroup is not None:
        return with_unit_uid(holder, uid_of_cgroup(cgroup), ids)
    if holder.uid is not None:
        return replace(holder, user=user_name(holder.uid))
    return holder


def _by_cgroup(port: int, sockets: list[Listener], proc: Path, ids: IdMap) -> list[Holder]:
    """Holders of sockets whose process is not visible: the unit and processes of the cgroup
    each socket was opened in (the only process there is its holder), else the socket alone."""
    mount = cgroup2_mount() if sockets else None
    try:
        opened_in = listening_cgroups(port) if mount is not None else {}
    except OSError:
        opened_in = {}
    found = []
    for listener in sockets:
        holder = Holder(port=port, uid=_visible_uid(listener.uid, ids), inode=listener.inode)
        cgroup_id = opened_in.get(listener.inode)
        path = cgroup_path(mount, cgroup_id) if mount is not None and cgroup_id else None
        pids = cgroup_pids(mount, path) if mount is not None and path is not None else []
        if path is not None and pids:
            holder = _named(_in_cgroup(holder, pids, path, proc), path, ids)
        else:
            holder = _named(holder, None, ids)
        found.append(holder)
    return found


def _in_cgroup(holder: Holder, pids: list[int], path: str, proc: Path) -> Holder:
    unit = unit_of_cgroup(f"0::{path}")
    if len(pids) == 1:
        (pid,) = pids
        return replace(
            holder, pid=pid, command=_command(proc, pid), unit=unit, started=_started(proc, pid)
        )
    # One of them holds it: if the last of them started before some time, so did the holder.
    starts = [_started(proc, pid) for pid in pids]
    known = [s for s in starts if s is not None]
    latest = max(known) if len(known) == len(starts) else None
    return replace(holder, unit=unit, pids=tuple(sorted(pids)), started=latest)


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


def _cgroup(proc: Path, pid: int) -> str | None:
    try:
        return (proc / str(pid) / "cgroup").read_text(errors="replace")
    except OSError:
        return None


def _started(proc: Path, pid: int) -> float | None:
    """The process's start (epoch seconds): /proc/PID/stat's starttime after /proc/stat's btime."""
    try:
        stat = (proc / str(pid) / "stat").read_text(errors="replace")
        boot = (proc / "stat").read_text(errors="replace")
    except OSError:
        return None
    # btime is whole seconds: up to a second off, enough to call a holder that started after a
    # unit's start older than it. The live clocks give the boot's time to the tick.
    booted = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) if proc == PROC else None
    return process_start(stat, boot, os.sysconf("SC_CLK_TCK"), booted=booted)


def process_start(
    stat: str, boot: str, ticks_per_s: int, *, booted: float | None = None
) -> float | None:
    """Epoch seconds of a process's start from its stat line and the system's /proc/stat
    (its btime, unless `booted` gives the boot's time more exactly)."""
    _, _, after_comm = stat.rpartition(")")  # the command may hold spaces and parentheses
    fields = after_comm.split()
    btime = None
    for words in map(str.split, boot.splitlines()):
        if len(words) == 2 and words[0] == "btime":
            btime = words[1]
    if len(fields) < 20 or btime is None or ticks_per_s <= 0:
        return None
    try:
        return (booted if booted is not None else int(btime)) + int(fields[19]) / ticks_per_s
    except ValueError:
        return None
