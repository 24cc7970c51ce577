"""Log events as native journal entries: a PRIORITY, a MESSAGE_ID per kind, fields to match.

Under systemd the daemon's stderr is a journal stream, where every line gets the unit's one
priority: `journalctl -u vllm-supervisor -p warning` showed nothing even when a halt failed. So
when stderr is that stream (`$JOURNAL_STREAM` names its device and inode, systemd.exec(5)), each
event is sent to journald's socket as a native entry instead: its PRIORITY from the level, a
readable MESSAGE, a MESSAGE_ID for the kinds an operator looks for (so `journalctl
MESSAGE_ID=...` finds every halt and `journalctl -x` explains it from deploy/catalog/), the
unit, invocation, signature, severity and action as fields, and the whole event as EVENT_JSON.

The protocol is systemd's "Native Journal Protocol": one datagram of `KEY=value` lines, a value
holding a newline sent as `KEY`, a newline, its length as 64-bit little endian, the bytes and a
newline. That is a dozen lines of code; python-systemd would bring a C extension and libsystemd
into the daemon's own process for it. A datagram journald refuses (too large, the socket gone)
falls back to the JSON line on stderr, so nothing is lost.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any, TextIO

JOURNAL_SOCKET = "/run/systemd/journal/socket"
IDENTIFIER = "vllm-supervisor"

# `journalctl MESSAGE_ID=...` per kind of event; deploy/catalog/vllm-supervisor.catalog explains
# each (tests/test_journald.py keeps the two in step).
MESSAGE_IDS: Mapping[str, str] = {
    "unit_halted": "156fe25805b74f8a8f622d3a7d194857",
    "halt_failed": "f3495385bd1f4d3489f6cad6627191d1",
    "unit_released": "7df064c87db548a8a74bc8b66a17773e",
    "engine_hung": "f869c3c978f04c7792849d440757fdf0",
    "start_refused": "1d469d04c7f647bc8f2d98b9ca9dfe2c",
    "backlog_recorded": "67c99acaafe1410594941eef3b73ab1b",
}
# syslog priorities (sd-daemon(3)); a halt is a warning: the server is down on purpose.
PRIORITIES: Mapping[str, int] = {
    "critical": 2,
    "exception": 3,
    "error": 3,
    "warning": 4,
    "warn": 4,
    "info": 6,
    "debug": 7,
}
# Event keys that become journal fields of their own, to match on.
FIELDS: Mapping[str, str] = {
    "unit": "SUPERVISED_UNIT",
    "invocation_id": "SUPERVISED_INVOCATION_ID",
    "signature": "SIGNATURE",
    "severity": "SEVERITY",
    "action": "ACTION",
    "rule": "RULE",
    "taken": "TAKEN",
}
_MESSAGE_KEYS = ("unit", "signature", "root_cause", "action", "taken", "detail", "reason", "error")


def under_journald(environ: Mapping[str, str] = os.environ, stream: TextIO = sys.stderr) -> bool:
    """True when `stream` is the journal stream systemd connected (JOURNAL_STREAM=dev:inode)."""
    device, sep, inode = environ.get("JOURNAL_STREAM", "").partition(":")
    if not sep:
        return False
    try:
        info = os.fstat(stream.fileno())
    except (OSError, ValueError):
        return False
    return f"{info.st_dev}:{info.st_ino}" == f"{device}:{inode}"


def entry(event: Mapping[str, Any]) -> dict[str, str]:
    """The journal fields of one structlog event (after add_log_level and TimeStamper)."""
    name = str(event.get("event", ""))
    level = str(event.get("level", "info"))
    fields = {
        "MESSAGE": message(event),
        "PRIORITY": str(PRIORITIES.get(level, 6)),
        "SYSLOG_IDENTIFIER": IDENTIFIER,
        "EVENT": name,
    }
    if name in MESSAGE_IDS:
        fields["MESSAGE_ID"] = MESSAGE_IDS[name]
    for key, field in FIELDS.items():
        value = event.get(key)
        if value is not None and value != "":
            fields[field] = str(value)
    fields["EVENT_JSON"] = json.dumps(event, default=str, ensure_ascii=False)
    return fields


def message(event: Mapping[str, Any]) -> str:
    """One readable line: the event, then the keys a person reads first."""
    parts = [f"{k}={event[k]}" for k in _MESSAGE_KEYS if event.get(k) not in (None, "")]
    return " ".join([str(event.get("event", "")), *parts])


def encode(fields: Mapping[str, str]) -> bytes:
    """The native protocol's datagram for `fields` (names: A-Z, 0-9 and _)."""
    out = bytearray()
    for key, value in fields.items():
        data = value.encode("utf-8", "replace")
        if b"\n" in data:
            out += key.encode("ascii") + b"\n" + struct.pack("<Q", len(data)) + data + b"\n"
        else:
            out += key.encode("ascii") + b"=" + data + b"\n"
    return bytes(out)


class JournalLogger:
    """A structlog logger that sends each rendered event to journald's socket."""

    def __init__(self, path: str = JOURNAL_SOCKET, fallback: TextIO = sys.stderr) -> None:
        self._path = path
        self._fallback = fallback
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def msg(self, rendered: Mapping[str, Any]) -> None:
        """Send one event; on a refusal, write its JSON line to the fallback stream."""
        fields = entry(rendered)
        try:
            self._socket.sendto(encode(fields), self._path)
        except OSError:
            # Too large for a datagram (journald would want a memfd), or no journald: the
            # stream still reaches the journal, at the unit's priority.
            print(fields["EVENT_JSON"], file=self._fallback, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


class JournalLoggerFactory:
    """structlog's logger_factory: one socket for the process."""

    def __init__(self, path: str = JOURNAL_SOCKET) -> None:
        self._logger = JournalLogger(path)

    def __call__(self, *args: object) -> JournalLogger:
        return self._logger


def as_event(
    _: object, __: str, event: MutableMapping[str, Any]
) -> tuple[tuple[MutableMapping[str, Any]], dict[str, Any]]:
    """The last processor under journald: the event dict itself goes to JournalLogger.msg
    (structlog passes a returned tuple as the logger call's arguments)."""
    return (event,), {}
