"""What a halt rests on, kept in its quarantine record, and whether it still holds.

A halt must last until what caused it changes, no longer: a port that another process held
during a restart is free a minute later, and a model on a network mount that was not there yet
at boot appears 20 s on. The record keeps that evidence; the gate asks `changed` before it
refuses a start (a stat or one read of /proc/net: well under 50 ms) and lets the start through
once the cause is gone. Evidence that cannot be checked keeps the halt: only a record says no.
While a halt's port is still held, the gate names the holder as root sees it (`still_holds`):
the daemon, under PrivateUsers=, may have found its uid and PID hidden.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ..decide.port_evidence import port_of
from ..environment.ports import holders, listeners
from ..model import Outcome, Rule

EVIDENCE_KEY = "evidence"
# Python's FileNotFoundError and the engines' own "does not exist" for a model or file path.
_MISSING_PATH = (
    re.compile(r"No such file or directory: '(?P<path>/[^'\x00]+)'"),
    re.compile(r"(?:[Pp]ath|[Dd]irectory|[Ff]ile|model) '?(?P<path>/[^'\s\x00]+)'? does not exist"),
)


def evidence_of(outcome: Outcome) -> dict[str, Any] | None:
    """What the outcome's halt rests on that can change without anyone releasing it."""
    verdict = outcome.verdict
    if outcome.decision.rule is Rule.PORT_HELD:
        port = port_of(dict(verdict.captures), verdict.root_cause, None)
        return None if port is None else {"kind": "port_held", "port": port}
    for pattern in _MISSING_PATH:
        found = pattern.search(verdict.root_cause or "")
        if found is not None:
            return {"kind": "missing_path", "path": found.group("path")}
    return None


def changed(record: dict[str, Any]) -> str | None:
    """What changed since the halt, in words, or None while its cause still holds."""
    evidence = record.get(EVIDENCE_KEY)
    if not isinstance(evidence, dict):
        return None
    kind = evidence.get("kind")
    if kind == "port_held":
        port = evidence.get("port")
        if isinstance(port, int) and 0 < port < 65536 and not listeners(port):
            return f"port {port} is free now"
    elif kind == "missing_path":
        path = evidence.get("path")
        if isinstance(path, str) and path.startswith("/") and os.path.exists(path):  # noqa: PTH110
            return f"{path} exists now"
    return None


def still_holds(record: dict[str, Any]) -> str | None:
    """Who holds a port_held halt's port now, in words, or None. The gate runs as root and
    sees every holder's PID and uid, which the daemon's namespace (PrivateUsers=) may hide."""
    evidence = record.get(EVIDENCE_KEY)
    if not isinstance(evidence, dict) or evidence.get("kind") != "port_held":
        return None
    port = evidence.get("port")
    if not isinstance(port, int) or not 0 < port < 65536:
        return None
    try:
        found = holders(port)
    except (OSError, ValueError):
        return None
    if not found:
        return None
    return f"port {port} is still held by " + "; ".join(h.describe() for h in found)
