"""A port-in-use crash, judged by who holds the port now.

`Address already in use` is transient when the holder is the crashed server's own process
still exiting (it goes with the unit's cgroup) or already gone, and fatal when the holder
outlives the unit's restarts (an orphaned server, a manual run, another unit): each restart
of a large model reloads its weights just to fail to bind again. Outlives means either

- the holder's process started before the crashed invocation did (it was there all along and
  its cgroup is not the unit's), or
- the same listening socket (its inode) held the port when the invocation started (PID 1's
  "Starting U...", read live, for a unit whose `port` is configured), or at the unit's previous
  crash: the holder's PID may be invisible to the daemon's user (another user's open files),
  the socket table is not.

The hook only gathers this evidence (`PortHeld`), before the decision; `port_verdict` makes the
verdict fatal and the policy halts it (`port_held`). Otherwise the holder is named and the
restart goes ahead. Only a crash that ended moments ago
(`systemd.act_window_s`), on this host, a crash (not a stop or a skip), whose cause is the bind
error itself (not a warning, not a line logged long before) and that never logged it serves,
is judged so; the holder today says nothing of a crash read from yesterday's journal.

Under the shipped hardened unit (its own user, PrivateUsers=yes) a holder of another user has
no visible PID and its uid shows as 65534, which is nobody's: the holder is named by the cgroup
its socket was opened in (its unit and that unit's processes, supervisor.environment.ports)
and by the uid systemd runs that unit as (`unit_uid`, over D-Bus); what stays unknown is said
to be hidden, never 65534. Where even the cgroup says nothing (a cgroup v1 host), the socket's
identity is the evidence, and a leftover of the unit's own previous run (KillMode=process)
counts as a holder that outlived a restart, which it did.
`halt_inferred = false` turns the halt into a note.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import structlog

from ..config import Config
from ..engines.profiles import Engines, follow
from ..environment.ports import (
    PORT_SIGNATURES,
    Holder,
    Listener,
    holders,
    listeners,
    with_unit_uid,
)
from ..environment.userns import IdMap, own_id_map
from ..errors import SystemdError
from ..model import (
    ENDINGS,
    Basis,
    Confidence,
    Ended,
    Evidence,
    Invocation,
    JournalEntry,
    LifecycleEvent,
    PortHeld,
    Severity,
    Verdict,
)

log = structlog.get_logger(__name__)

_GENERIC_PORT_IN_TEXT = (
    re.compile(r"\('[^']*', (\d{1,5})\b"),  # uvicorn: ('0.0.0.0', 8000)
    re.compile(r"\]:(\d{1,5})\b"),  # torch: [::]:29500
    re.compile(r"\bport:? (\d{1,5})\b", re.IGNORECASE),
)
# Then the engine files' port_lines (SGLang: metrics_port at 40290).
_PORT_IN_TEXT: tuple[re.Pattern[str], ...]


def _use_engines(engines: Engines) -> None:
    """The port lines of the engine files in force (profiles.follow)."""
    global _PORT_IN_TEXT
    _PORT_IN_TEXT = (*_GENERIC_PORT_IN_TEXT, *map(re.compile, engines.port_lines))


follow(_use_engines)
Holders = Callable[[int], list[Holder]]
Listeners = Callable[[int], list[Listener]]
UnitUid = Callable[[str], Awaitable[int | None]]  # the uid systemd runs a unit as (None: unset)
_UNIT_UID_TIMEOUT_S = 2.0  # the gates wait on this decision
_STARTING: str = LifecycleEvent.STARTING.value  # read per entry: not the enum's property
_LIVE_S = 5.0  # a start read later than this: the socket table now says nothing of then
_STARTS_KEPT = 64


def port_of(captures: dict[str, str], root_cause: str | None, configured: int | None) -> int | None:
    """The port the crash could not bind: the signature's capture, the message, the config."""
    for text in (captures.get("port"), *_in_text(root_cause)):
        if text is not None and text.isascii() and text.isdigit() and 0 < int(text) < 65536:
            return int(text)
    return configured


def _in_text(text: str | None) -> list[str]:
    if not text:
        return []
    return [m.group(1) for pattern in _PORT_IN_TEXT if (m := pattern.search(text))]


class PortEvidence:
    """The daemon's hook: the evidence of who holds a crash's port, and whether it outlives the
    unit's restarts (the verdict and the policy make of it a note or a halt)."""

    def __init__(
        self,
        config: Config,
        *,
        find: Holders = holders,
        find_listeners: Listeners = listeners,
        clock: Callable[[], float] = time.time,
        machine_id: str | None = None,
        unit_uid: UnitUid | None = None,
        ids: IdMap | None = None,
    ) -> None:
        self.config = config
        self._machine_id = machine_id  # the host whose /proc this is
        self._find = find
        self._unit_uid = unit_uid
        self._ids = ids if ids is not None else own_id_map()
        self._clock = clock
        self._find_listeners = find_listeners
        self._held: dict[str, set[int]] = {}  # per unit: the sockets that held its port
        # Per (unit, invocation): the sockets on its port when it started.
        self._at_start: OrderedDict[tuple[str, str], set[int]] = OrderedDict()

    def entries(self, batch: list[JournalEntry]) -> list[JournalEntry]:
        """Note who listens on a unit's port when PID 1 starts it (read live: one read of the
        socket table, no process scan); entries pass unchanged."""
        for entry in batch:
            if not entry.from_pid1 or entry.message_id != _STARTING:
                continue
            if entry.unit is None or entry.invocation_id is None:
                continue
            port = self.config.unit(entry.unit).port
            if port is None or self._clock() - entry.realtime_us / 1e6 > _LIVE_S:
                continue
            try:
                inodes = {s.inode for s in self._find_listeners(port)}
            except OSError:
                continue
            self._at_start[(entry.unit, entry.invocation_id)] = inodes
            while len(self._at_start) > _STARTS_KEPT:
                self._at_start.popitem(last=False)
        return batch

    def reconfigure(self, config: Config) -> None:
        """A reloaded config: units, ports, dry run."""
        self.config = config

    async def evidence(self, ended: Ended, evidence: Evidence) -> Evidence:
        """The evidence with the port's holder now, for a crash judged here (`_judged_here`);
        unchanged otherwise, or when the holders cannot be read."""
        if not self._judged_here(ended):
            return evidence
        reading, inv = ended.reading, ended.invocation
        assert inv.unit is not None  # noqa: S101 - _judged_here checked it
        port = port_of(dict(reading.captures), reading.root_cause, self.config.unit(inv.unit).port)
        if port is None:
            return evidence
        try:
            # A scan of /proc/*/fd: off the event loop, the gates wait on it.
            found = [h for h in await asyncio.to_thread(self._find, port) if h.unit != inv.unit]
        except OSError as exc:
            log.warning("port_holder_lookup_failed", unit=inv.unit, port=port, error=str(exc))
            return evidence
        found = [await self._uid_from_systemd(h) for h in found]
        before = self._held.get(inv.unit, set()) | self._at_start.pop(
            (inv.unit, inv.invocation_id or ""), set()
        )
        self._held[inv.unit] = {h.inode for h in found}
        if not found:
            return dataclasses.replace(evidence, port=PortHeld(port=port, holders=None))
        named = "; ".join(h.describe() for h in found)
        older = any(
            h.started is not None
            and inv.started_us is not None
            and h.started < inv.started_us / 1e6
            for h in found
        )
        outlives = older or any(h.inode in before for h in found)
        if outlives:
            log.info("port_held", unit=inv.unit, port=port, holders=named)
        held = PortHeld(port=port, holders=named, before_start=older, outlives=outlives)
        return dataclasses.replace(evidence, port=held)

    async def _uid_from_systemd(self, holder: Holder) -> Holder:
        """The holder with its unit's uid where the namespace hides the socket's (systemd's
        word over D-Bus, not namespaced); unchanged when systemd cannot say."""
        if holder.uid is not None or holder.unit is None or self._unit_uid is None:
            return holder
        try:
            async with asyncio.timeout(_UNIT_UID_TIMEOUT_S):
                uid = await self._unit_uid(holder.unit)
        except (SystemdError, OSError, TimeoutError) as exc:
            log.info("port_holder_uid_unknown", unit=holder.unit, error=str(exc))
            return holder
        return await asyncio.to_thread(with_unit_uid, holder, uid, self._ids)

    def _judged_here(self, ended: Ended) -> bool:
        """A port-in-use crash of a start on this host that just ended, a crash (not a stop,
        a skip), whose cause is the bind error itself (not a warning or an old line), before
        the server logged it serves: only then does the holder now tell about it."""
        reading, inv = ended.reading, ended.invocation
        if reading.signature not in PORT_SIGNATURES or not inv.failed:
            return False
        if not crash_here_now(inv, self._clock(), self.config, self._machine_id):
            return False
        if reading.from_context or reading.confidence is Confidence.LOW:
            return False
        # A server that logged it serves had bound its port (a long load is not serving: a
        # large model may load for 10+ minutes, then fail to bind).
        return not inv.served


def crash_here_now(inv: Invocation, now: float, config: Config, machine_id: str | None) -> bool:
    """A crash (not a stop, a skip) of a unit on this host that ended moments ago: only of
    such a crash does this host's state now (who holds a port, which addresses it has) tell."""
    if inv.unit is None or inv.ended_us is None:
        return False
    if now - inv.ended_us / 1e6 > config.systemd.act_window_s:
        return False  # history: the host now says nothing about then
    if inv.host is not None and machine_id is not None and inv.host != machine_id:
        return False  # another host's crash: this host says nothing of it
    return ENDINGS[inv.ending].not_a_crash is None


def port_verdict(
    verdict: Verdict, held: PortHeld | None, unit: str, *, halt_inferred: bool
) -> Verdict:
    """The verdict as the port's holder makes it: a holder that outlives the unit's restarts
    makes it fatal (the policy halts it, `port_held`), unless `halt_inferred` is off; any
    other finding is a note. Part of building the verdict, before the decision."""
    if held is None:
        return verdict
    port = held.port
    if held.holders is None:
        note = f"port {port} is not held by another process now"
    elif not held.outlives:
        note = f"port {port} held by {held.holders}; halted if it still holds it at the next crash"
    elif not halt_inferred:
        note = f"port {port} held by {held.holders}, there before this start"
    else:
        reason = (
            f"fatal: port {port} is held by {held.holders}, which was there before this start "
            f"and outlives the unit's restarts: stop it, then `vllm-supervisor release {unit}`"
        )
        return dataclasses.replace(
            verdict,
            severity=Severity.FATAL,
            basis=Basis.INFERRED,
            confidence=Confidence.HIGH if held.before_start else Confidence.MEDIUM,
            severity_reason=reason,
            notes=(*verdict.notes, f"port {port} held by {held.holders}"),
            # The port a log line may not name (`Address already in use`) is the one the
            # quarantine record keeps for the gate's re-check (supervisor.actions.evidence).
            captures={**verdict.captures, "port": str(port)},
        )
    return dataclasses.replace(verdict, notes=(*verdict.notes, note))
