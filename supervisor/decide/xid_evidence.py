"""The GPU's own fault beside the crash: the kernel's Xid joined to the engine's error.

The driver logs `NVRM: Xid (PCI:0000:3b:00): 79, ... GPU has fallen off the bus.` to the
kernel's log; the engine dies a moment later with `CUDA error: unspecified launch failure`,
which names no cause. `XidEvidence` keeps the Xids the kernel source (supervisor.journal.kernel)
read, per host and boot, and joins one to an ended invocation of the same host and boot when
it was logged at most `window_s` before the invocation's first error line (and not after its
end). `xid_verdict` then makes the Xid the root cause, the engine's error what it caused, and
the severity the catalog's (config/xid.toml): a reset or a reboot needed is fatal (halted at
the 1st crash; the halt lifts after a reboot, supervisor.actions.evidence), NVIDIA's "restart
the application" is transient. An Xid of another host or boot, or outside the window, is never
joined; a crash without one is decided as before. Where the unit's own GPUs can be known (its
CUDA_VISIBLE_DEVICES mapped through the driver's table: supervisor.environment.gpus), only their
Xids are joined: another unit's GPU faulting next to this crash is not its cause.

The daemon counts every Xid it reads (`vllm_supervisor_gpu_xid_total{pci, xid}`), whether or
not an engine crashed; `triage` of a saved journal reads its kernel lines the same way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import structlog

from ..classify.fingerprint import fingerprint
from ..classify.logline import parse_line
from ..classify.xid import XidCatalog, XidLine, load_xid_catalog, parse_xid
from ..config import Config
from ..environment.gpus import device_key
from ..errors import ConfigError
from ..journal.kernel import KernelLine
from ..model import (
    Basis,
    Confidence,
    Ended,
    Evidence,
    GpuXid,
    Invocation,
    JournalEntry,
    Severity,
    Verdict,
)

log = structlog.get_logger(__name__)

WINDOW_S = 60.0  # an Xid this long before the engine's first error line is its cause
KEPT = 512  # Xids remembered (per daemon): far more than any window holds
_ERROR_LEVELS = frozenset({"ERROR", "CRITICAL"})  # parse_line's levels
_LOOKS_BAD = re.compile(r"(?:Error|Exception)\b|\b(?:ERROR|CRITICAL|FATAL|[Ff]atal)\b")
_TAIL_S = 120.0  # the first error is looked for in the invocation's last this many seconds


class XidEvidence:
    """The daemon's hook: the Xid of the crashed invocation's GPU, when the kernel logged one."""

    def __init__(
        self,
        catalog: XidCatalog,
        *,
        counted: Callable[[str, str], None] | None = None,
        window_s: float = WINDOW_S,
        lookup: Callable[[float, float], list[KernelLine]] | None = None,
        gpus_of: Callable[[str, str], Awaitable[frozenset[str] | None]] | None = None,
        machine_id: str = "",
    ) -> None:
        self.catalog = catalog
        # The unit's GPUs (supervisor.environment.gpus: device keys), None when unknown: an Xid
        # of another unit's GPU is not this crash's cause.
        self._gpus_of = gpus_of
        self._machine_id = machine_id  # whose units' GPUs `gpus_of` can tell
        self._counted = counted
        # The kernel's lines between two times, read at once: the follower may not have read
        # the Xid yet when the crash is decided (both read the journal as it grows).
        self._lookup = lookup
        self._window_us = int(window_s * 1_000_000)
        self._seen: deque[tuple[KernelLine, XidLine]] = deque(maxlen=KEPT)

    # -- what the kernel said ------------------------------------------------------------------

    def note(self, line: KernelLine) -> None:
        """One of the driver's kernel lines: an Xid is kept and counted once (the periodic pass
        and a crash's own read may both bring it); others pass."""
        xid = parse_xid(line.text)
        if xid is None or any(
            seen.realtime_us == line.realtime_us and seen.text == line.text
            for seen, _ in self._seen
        ):
            return
        self._seen.append((line, xid))
        if self._counted is None:
            return  # triage: nothing to count or say while reading
        entry = self.catalog.get(xid.code)
        self._counted(xid.pci, str(xid.code) if entry is not None else "other")
        log.warning(
            "gpu_xid",
            pci=xid.pci,
            xid=xid.code,
            meaning=entry.meaning if entry else "not in the Xid catalog",
            action=entry.what_to_do if entry else "see NVIDIA's Xid catalog",
            line=xid.text[:300],
        )

    def note_all(self, lines: Iterable[KernelLine]) -> None:
        for line in lines:
            self.note(line)

    # -- the hook ------------------------------------------------------------------------------

    def entries(self, batch: list[JournalEntry]) -> list[JournalEntry]:
        return batch

    def reconfigure(self, config: Config) -> None:
        """Nothing of the config: the catalog is reloaded by `reload`."""

    async def reload(self, config: Config) -> list[str]:
        """At a reload, the catalog read again (config/xid.toml); one that does not load
        keeps the one in use, with one line. A part of the reload (loop/reload.py)."""
        try:
            self.catalog = await asyncio.to_thread(load_xid_catalog, Path(self.catalog.source))
        except ConfigError as exc:
            log.error("xid_catalog_not_reloaded", error=str(exc), action="the old one stays")
        return []

    async def evidence(self, ended: Ended, evidence: Evidence) -> Evidence:
        """`joined`, after reading the kernel's lines around the crash at once when its own
        lines speak of the GPU (a CUDA error, ECC, a lost device): the follower may lag."""
        inv = ended.invocation
        first = None
        if self._lookup is not None and inv.ended_us is not None and _may_be_the_gpus(ended):
            first = first_error_us(inv)
            since = (first - self._window_us) / 1e6
            lines = await asyncio.to_thread(self._lookup, since, inv.ended_us / 1e6 + 1)
            self.note_all(lines)
        joined = self._joined(ended, evidence, first)
        if joined.xid is None or self._gpus_of is None:
            return joined
        if self._machine_id and inv.host and inv.host != self._machine_id:
            return joined  # another machine's unit: its GPUs cannot be asked here
        gpus = await self._gpus_of(inv.unit or "", joined.xid.pci)
        if gpus is None or device_key(joined.xid.pci) in gpus:
            return joined
        log.info(
            "gpu_xid_not_this_units",
            unit=inv.unit,
            pci=joined.xid.pci,
            xid=joined.xid.code,
            gpus=sorted(gpus),
        )
        return self._joined(ended, evidence, first, only=gpus)

    def joined(self, ended: Ended, evidence: Evidence) -> Evidence:
        """`evidence` with the Xid the crash's host and boot logged just before its first
        error; unchanged when there is none (or the invocation's boot is not known)."""
        return self._joined(ended, evidence, None)

    def _joined(
        self,
        ended: Ended,
        evidence: Evidence,
        first: int | None,
        *,
        only: frozenset[str] | None = None,
    ) -> Evidence:
        """`joined`, given the first error line's time when it was read already; with `only`,
        among the Xids of those GPUs (device keys) alone."""
        inv = ended.invocation
        if not inv.failed or inv.boot_id is None or inv.ended_us is None:
            return evidence
        ended_us = inv.ended_us
        # Most crashes have no Xid near them: the invocation's lines are read only then.
        near = [
            (line, xid)
            for line, xid in self._seen
            if line.boot_id == inv.boot_id
            and (inv.host is None or line.host is None or line.host == inv.host)
            and line.realtime_us <= ended_us
            and ended_us - line.realtime_us <= self._window_us + _TAIL_S * 1_000_000
            and (only is None or device_key(xid.pci) in only)
        ]
        if not near:
            return evidence
        first = first if first is not None else first_error_us(inv)
        found = [f for f in near if first - self._window_us <= f[0].realtime_us]
        if not found:
            return evidence
        # The one a restart cannot get past says most, then one that is no mere follower or
        # note (Xid 45, 154: their action is "none"), then the latest.
        # An Xid that follows another (45: "caused by previous Xid 149") is decided as that one.
        line, xid = max(found, key=lambda f: (*self._weight(f[1].cause), f[0].realtime_us))
        entry = self.catalog.get(xid.cause)
        joined = GpuXid(
            code=xid.cause,
            pci=xid.pci,
            line=xid.text,
            realtime_us=line.realtime_us,
            boot_id=line.boot_id,
            meaning=entry.meaning if entry else None,
            action=entry.action if entry else None,
            what_to_do=entry.what_to_do if entry else None,
            restart_helps=self._helps(xid.cause),
        )
        return dataclasses.replace(evidence, xid=joined)

    def _weight(self, code: int) -> tuple[bool, bool]:
        entry = self.catalog.get(code)
        return (not self._helps(code), entry is not None and entry.action != "none")

    def _helps(self, code: int) -> bool:
        entry = self.catalog.get(code)
        return entry is None or entry.restart_helps


# A cause that speaks of the GPU (the engine's CUDA error after a fault, a lost device).
_GPU_WORDS = re.compile(
    r"(?i)\bcuda\b|cudaError|\bGPUs?\b|\bECC\b|\bNVML\b|\bNCCL\b|\bXid\b|device-side|"
    r"illegal memory access|launch failure|no CUDA-capable device"
)


def _may_be_the_gpus(ended: Ended) -> bool:
    """The crash's cause, as its lines tell it, speaks of the GPU, or its lines name none
    (a process killed without a word): only then are the kernel's lines read at once, so a
    crash of another kind (the seed's version mismatch) is decided as fast as before."""
    reading = ended.reading
    cause = reading.root_cause or ""
    return not cause or reading.confidence is Confidence.LOW or bool(_GPU_WORDS.search(cause))


def first_error_us(inv: Invocation) -> int:
    """When the crash's first error line was logged: the earliest error line of the
    invocation's last `_TAIL_S` seconds; its end when none has a time."""
    end = inv.ended_us or 0
    times = [
        line.realtime_us
        for line in inv.lines
        if line.realtime_us is not None
        and end - line.realtime_us <= _TAIL_S * 1_000_000
        and (parse_line(line).level in _ERROR_LEVELS or _LOOKS_BAD.search(line.text))
    ]
    return min(times, default=end)


def xid_verdict(verdict: Verdict, xid: GpuXid | None) -> Verdict:
    """The verdict as the GPU's Xid makes it: the Xid is the root cause, the engine's error
    what it caused; fatal when a restart cannot help, transient when NVIDIA says restart."""
    if xid is None:
        return verdict
    caused = verdict.root_cause or "the engine's exit"
    meaning = xid.meaning or "an Xid the catalog does not list (see NVIDIA's Xid catalog)"
    todo = xid.what_to_do or "look it up in NVIDIA's Xid catalog"
    severity = Severity.TRANSIENT if xid.restart_helps else Severity.FATAL
    if xid.meaning is None:
        severity = verdict.severity  # nothing known of it: the crash is decided as it was
    return dataclasses.replace(
        verdict,
        # The engine's signature named what the fault caused, not its cause.
        signature=None,
        packages=(),
        title=f"GPU fault: Xid {xid.code} on {xid.pci}: {meaning}",
        root_cause=xid.line,
        severity=severity,
        basis=Basis.SIGNATURE if xid.meaning is not None else verdict.basis,
        confidence=Confidence.HIGH,
        severity_reason=(
            f"the kernel logged Xid {xid.code} for GPU {xid.pci} just before the crash "
            f"({meaning}): NVIDIA's action is to {todo}"
            + ("" if xid.restart_helps else "; a restart of the engine alone cannot get past it")
        ),
        remediation=f"GPU {xid.pci}, Xid {xid.code}: {todo}.",
        fingerprint=fingerprint(f"NVRM Xid {xid.code} {xid.pci}"),
        captures={"xid": str(xid.code), "pci": xid.pci},
        notes=(*verdict.notes, f"what the GPU's fault caused: {caused[:300]}"),
    )
