"""Which uids this process's user namespace can name, and which it shows as the overflow uid.

Under `PrivateUsers=yes` systemd maps only root and the unit's own user into the daemon's
namespace; the kernel shows every other uid, in /proc/net/tcp, /proc/PID/status and sock_diag
alike, as the overflow uid (65534, /proc/sys/kernel/overflowuid). A 65534 read there is then no
uid at all: "someone else". Only where the overflow uid is itself mapped (the host's own
namespace maps every uid) is 65534 the real `nobody`.
"""

from __future__ import annotations

import pwd
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
DEFAULT_OVERFLOW_UID = 65534
_ALL_UIDS = ((0, 0, 0xFFFFFFFF),)  # the host's own /proc/self/uid_map


@dataclass(frozen=True, slots=True)
class IdMap:
    """The uid ranges a namespace maps, (inside, outside, count), and the kernel's overflow uid."""

    ranges: tuple[tuple[int, int, int], ...] = _ALL_UIDS
    overflow: int = DEFAULT_OVERFLOW_UID

    def maps(self, uid: int) -> bool:
        """True when `uid`, as the host knows it, has a name inside this namespace."""
        return any(outside <= uid < outside + count for _, outside, count in self.ranges)

    def hides(self, seen: int) -> bool:
        """True when `seen`, a uid the kernel showed inside this namespace, stands for a uid
        the namespace does not map (it is the overflow uid, and that one is unmapped)."""
        if seen != self.overflow:
            return False
        return not any(inside <= seen < inside + count for inside, _, count in self.ranges)


def parse_uid_map(text: str) -> tuple[tuple[int, int, int], ...] | None:
    """The ranges of a /proc/PID/uid_map text; None when any line is not three numbers."""
    ranges = []
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if len(words) != 3 or not all(w.isascii() and w.isdigit() for w in words):
            return None
        inside, outside, count = (int(w) for w in words)
        ranges.append((inside, outside, count))
    return tuple(ranges) or None


def own_id_map(proc: Path = PROC) -> IdMap:
    """This process's namespace; the host's (every uid mapped) when /proc cannot tell."""
    try:
        ranges = parse_uid_map((proc / "self" / "uid_map").read_text(errors="replace"))
    except OSError:
        ranges = None
    try:
        overflow_text = (proc / "sys" / "kernel" / "overflowuid").read_text().strip()
        overflow = int(overflow_text) if overflow_text.isascii() and overflow_text.isdigit() else 0
    except OSError:
        overflow = 0
    return IdMap(ranges or _ALL_UIDS, overflow or DEFAULT_OVERFLOW_UID)


def user_name(uid: int) -> str | None:
    """The uid's user name (the passwd database, systemd's dynamic users included), or None."""
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return None
