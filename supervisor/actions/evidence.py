"""What a halt rests on, kept in its quarantine record, and whether it still holds.

A halt must last until what caused it changes, no longer: a port that another process held
during a restart is free a minute later, and a model on a network mount that was not there yet
at boot appears 20 s on. The record keeps that evidence; the gate asks `changed` before it
refuses a start (a stat or one read of /proc/net: well under 50 ms) and lets the start through
once the cause is gone. Evidence that cannot be checked keeps the halt: only a record says no.
While a halt's port is still held, the gate names the holder as root sees it (`still_holds`):
the daemon, under PrivateUsers=, may have found its uid and PID hidden.

Every halt also keeps a fingerprint of what the unit ran with (`environment_of`, see
supervisor.environment.fingerprint): its venv's distributions, its interpreter, its loaded
ExecStart=, Environment=, EnvironmentFile=s and unit files. `changed` lifts the halt once that
differs: a person who ran `pip install flashinfer-cubin==0.6.4` needs no `release`. That check
asks systemd over D-Bus and lists the venv: 17 ms median for 300 packages, 13 ms of it D-Bus
(`python -m bench.gate_recheck --nspawn`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from ..decide.port_evidence import port_of
from ..environment.addresses import could_not_bind, is_local
from ..environment.execstart import interpreter_from_exec_start
from ..environment.fingerprint import UnitSettings, changes, needs_settings, render, take
from ..environment.ports import holders, listeners
from ..environment.reach import hidden_by
from ..environment.unit_view import UnitView, exists_for
from ..errors import SystemdError
from ..model import Outcome, Rule
from .systemd import SystemdClient
from .unitsettings import ask_unit_settings, ask_unit_view, unit_settings

_log = structlog.get_logger(__name__)

EVIDENCE_KEY = "evidence"
ENVIRONMENT_KEY = "environment"
# Bounds on reading the fingerprint (~15 ms when all is well: bench/gate_recheck.py). At halt
# time it is read after the record and the stop, so it delays no refusal, only the halt's report
# (a slow bus or a hung mount then leaves it out); a refused start waits no longer for systemd.
HALT_SETTINGS_TIMEOUT_S = 0.25
HALT_FILES_TIMEOUT_S = 0.25
GATE_SYSTEMD_TIMEOUT_S = 0.5
# Python's FileNotFoundError and the engines' own "does not exist" for a model or file path.
_MISSING_PATH = (
    re.compile(r"No such file or directory: '(?P<path>/[^'\x00]+)'"),
    re.compile(r"(?:[Pp]ath|[Dd]irectory|[Ff]ile|model) '?(?P<path>/[^'\s\x00]+)'? does not exist"),
)


def evidence_of(outcome: Outcome) -> dict[str, Any] | None:
    """What the outcome's halt rests on that can change without anyone releasing it."""
    verdict = outcome.verdict
    if outcome.decision.rule is Rule.GPU_XID and (xid := verdict.captures.get("xid")):
        # The GPU needs a reset or a reboot: the halt lasts this boot (supervisor.decide.
        # xid_evidence); a record kept across a reboot (persistent_quarantine) lifts then.
        boot = outcome.invocation.boot_id
        return {"kind": "gpu_xid", "xid": xid, "pci": verdict.captures.get("pci"), "boot_id": boot}
    if outcome.decision.rule is Rule.PORT_HELD:
        port = port_of(dict(verdict.captures), verdict.root_cause, None)
        return None if port is None else {"kind": "port_held", "port": port}
    address = verdict.captures.get("address")
    if address and could_not_bind(verdict.root_cause):
        return {"kind": "address_missing", "address": address}
    for pattern in _MISSING_PATH:
        found = pattern.search(verdict.root_cause or "")
        if found is not None:
            return {"kind": "missing_path", "path": found.group("path")}
    return None


async def environment_of(
    unit: str,
    systemd: SystemdClient | None,
    *,
    python: str | None = None,
    hidden: Callable[[str], str | None] = hidden_by,
) -> dict[str, Any] | None:
    """The fingerprint of what `unit` ran with, for its quarantine record; None when nothing
    could be read. `python` is the configured interpreter; else the one its ExecStart= runs.
    Never raises: the halt it is part of must go on without it."""
    settings = None
    try:
        if systemd is not None:
            try:
                async with asyncio.timeout(HALT_SETTINGS_TIMEOUT_S):
                    settings = await unit_settings(systemd, unit)
            except (SystemdError, TimeoutError) as exc:
                _log.warning("halt_settings_unread", unit=unit, error=str(exc) or "timeout")
        async with asyncio.timeout(HALT_FILES_TIMEOUT_S):
            found = await asyncio.to_thread(_take, python, settings, hidden)
    except TimeoutError:
        _log.warning("halt_environment_unread", unit=unit, error="timeout")
        return None
    except Exception as exc:  # a fault of our own: the halt is worth more than its fingerprint
        _log.error("halt_environment_failed", unit=unit, error=repr(exc))
        return None
    return found or None


def _take(
    python: str | None, settings: UnitSettings | None, hidden: Callable[[str], str | None]
) -> dict[str, Any]:
    interpreter = Path(python) if python else None
    if interpreter is None and settings is not None and settings.exec_start:
        path, _, *args = settings.exec_start[0]  # argv[0] as written; path as systemd found it
        interpreter = interpreter_from_exec_start([path, *args])
    return take(interpreter=interpreter, settings=settings, hidden=hidden)


def changed(
    record: dict[str, Any],
    *,
    unit: str | None = None,
    settings: Callable[[str], UnitSettings | None] | None = None,
    view: Callable[[str], UnitView | None] | None = None,
) -> str | None:
    """What changed since the halt, in words, or None while its cause still holds.

    `settings` reads systemd's view of `unit` (default: over D-Bus, bounded), asked only when
    the record's fingerprint has something to compare it with; `view`, how the unit sees the
    file system (likewise), asked only for a missing path.
    """
    gone = cause_gone(record, unit=unit, view=view)
    if gone is not None:
        return gone
    fingerprint = record.get(ENVIRONMENT_KEY)
    if not isinstance(fingerprint, dict) or not fingerprint:
        return None
    name = unit if unit is not None else record.get("unit")
    now = None
    if isinstance(name, str) and needs_settings(fingerprint):
        read = settings or (lambda u: ask_unit_settings(u, timeout_s=GATE_SYSTEMD_TIMEOUT_S))
        now = read(name)
    named = record.get("packages")
    only = [str(n) for n in named] if isinstance(named, list) and named else None
    found = changes(fingerprint, now, packages=only)
    return f"{render(found)} since the halt" if found else None


# The halts whose cause can go away by itself: checked on a schedule (supervisor.actions.holds),
# they start the unit once it has (a port's holder left, a mount came up, an address was set).
CONDITION_KINDS = frozenset({"port_held", "missing_path", "address_missing"})


def waits_on_a_condition(record: dict[str, Any]) -> bool:
    """True for a halt that rests on a cause that can go away by itself (and on nothing that
    only a person ends: an unreadable record is no such halt)."""
    evidence = record.get(EVIDENCE_KEY)
    return isinstance(evidence, dict) and evidence.get("kind") in CONDITION_KINDS


def cause_gone(
    record: dict[str, Any],
    *,
    unit: str | None = None,
    view: Callable[[str], UnitView | None] | None = None,
) -> str | None:
    """What says the halt's own cause is gone, in words, or None while it holds (or it has no
    cause that can go): the environment's changes are not asked (an install may be half
    done, and only a person's start may begin on it).

    A missing path is looked for as `unit` sees it (supervisor.environment.unit_view): through
    its mounts, as its user. Where systemd cannot say how (no unit named, no answer), the
    path is not looked for: the halt stays, and the gate answers nobody whether it exists.
    """
    evidence = record.get(EVIDENCE_KEY)
    name = unit if unit is not None else record.get("unit")
    if not isinstance(evidence, dict):
        return None
    if evidence.get("kind") == "missing_path":
        path = evidence.get("path")
        if not (isinstance(path, str) and path.startswith("/") and isinstance(name, str)):
            return None
        read = view or (lambda u: ask_unit_view(u, timeout_s=GATE_SYSTEMD_TIMEOUT_S))
        seen = read(name)
        if seen is not None and exists_for(seen, path):
            return f"{path} exists now, as {name} sees it"
        return None
    return _cause_gone(evidence)


def _cause_gone(evidence: dict[str, Any]) -> str | None:
    """A port's, an address's or a GPU fault's halt: what says its cause is gone, or None."""
    kind = evidence.get("kind")
    if kind == "gpu_xid":
        boot = evidence.get("boot_id")
        now = current_boot_id()
        if isinstance(boot, str) and now is not None and boot != now:
            return f"the host rebooted since GPU {evidence.get('pci')}'s Xid {evidence.get('xid')}"
    if kind == "port_held":
        port = evidence.get("port")
        if isinstance(port, int) and 0 < port < 65536 and not listeners(port):
            return f"port {port} is free now"
    elif kind == "address_missing":
        address = evidence.get("address")
        if isinstance(address, str) and is_local(address):
            return f"{address} is an address of this host now"
    return None


def current_boot_id(path: Path = Path("/proc/sys/kernel/random/boot_id")) -> str | None:
    """This boot's id as the journal writes it (32 hex digits), or None when unreadable."""
    try:
        return path.read_text(encoding="ascii").strip().replace("-", "") or None
    except (OSError, UnicodeDecodeError):
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
