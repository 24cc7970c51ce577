"""A listen address that is not on this host: the crash's cause, and whether it still holds.

A server started before its address exists (a NIC that comes up late at boot, a VIP that
keepalived moves here later) fails to bind with `[Errno 99] Cannot assign requested address`.
A restart fails the same way until the address is there, and then works: such a crash is held
until the address exists, never halted for good. The address comes from the server's own
start-up lines (vLLM's `non-default args: {'host': ...}`, a `--host` on a command line); one
that is not an IP address (a host name) is not judged here.
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket
from collections.abc import Iterable

_HOST_IN_TEXT = (
    re.compile(r"'host': '([^'\s]+)'"),  # vLLM's "non-default args: {'host': '10.0.0.5', ...}"
    re.compile(r"--host[= ]([0-9A-Fa-f.:]+)\b"),  # a command line the server or a wrapper echoed
)
_NOT_ASSIGNED = re.compile(r"\[Errno 99\]|EADDRNOTAVAIL|[Cc]annot assign requested address")


def not_assigned(text: str | None) -> bool:
    """True when `text` (a crash's root cause) is the kernel's "not an address of this host"."""
    return bool(text) and _NOT_ASSIGNED.search(text or "") is not None


def listen_address(texts: Iterable[str]) -> str | None:
    """The IP address a server was told to listen on, from its lines; None when none names
    one (a host name, 0.0.0.0 or :: bind anywhere and are not judged)."""
    for text in texts:
        for pattern in _HOST_IN_TEXT:
            found = pattern.search(text)
            if found is None:
                continue
            try:
                address = ipaddress.ip_address(found.group(1))
            except ValueError:
                continue
            if not address.is_unspecified:
                return str(address)
    return None


def is_local(address: str) -> bool | None:
    """True when this host has `address` now (a socket binds to it), False when it does not,
    None when that cannot be told (not an IP address, no such family here)."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return None
    family = socket.AF_INET6 if parsed.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((str(parsed), 0))
    except OSError as exc:
        return False if exc.errno == errno.EADDRNOTAVAIL else None
    return True
