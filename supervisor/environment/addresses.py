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
# A bind failure in a server's own words, with no errno (llama.cpp's "couldn't bind HTTP server
# socket, hostname: H, port: P" is the same for a port in use and an address not here).
_BIND_FAILED = re.compile(r"(?i)\b(?:couldn't|could not|cannot|failed to|unable to) bind\b")
_ADDRESS_LIKE = re.compile(r"[0-9A-Fa-f]*[.:][0-9A-Fa-f.:]*[0-9A-Fa-f]")


def not_assigned(text: str | None) -> bool:
    """True when `text` (a crash's root cause) is the kernel's "not an address of this host"."""
    return bool(text) and _NOT_ASSIGNED.search(text or "") is not None


def could_not_bind(text: str | None) -> bool:
    """True when `text` (a crash's root cause) says an address could not be bound: errno 99,
    or a bind failure in a server's own words, whose address then tells what was missing."""
    return not_assigned(text) or _BIND_FAILED.search(text or "") is not None


def bind_address(root_cause: str | None, texts: Iterable[str]) -> str | None:
    """The address a bind failure names on its own line (llama.cpp's "hostname: 10.0.0.5"),
    else the server's listen address from its lines (`listen_address`)."""
    for candidate in _ADDRESS_LIKE.findall(root_cause or ""):
        address = _specific(candidate.strip(":."))
        if address is not None:
            return address
    return listen_address(texts)


def _specific(text: str) -> str | None:
    """`text` as an IP address that names one host (not 0.0.0.0 or ::); None otherwise."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    return None if address.is_unspecified else str(address)


def listen_address(texts: Iterable[str]) -> str | None:
    """The IP address a server was told to listen on, from its lines; None when none names
    one (a host name, 0.0.0.0 or :: bind anywhere and are not judged)."""
    for text in texts:
        for pattern in _HOST_IN_TEXT:
            found = pattern.search(text)
            address = None if found is None else _specific(found.group(1))
            if address is not None:
                return address
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
