"""The evidence of a listen address not on this host, and the verdict it makes.

`AddressEvidence` (a batch hook of the daemon's, like the port's holder) notes, for a start-up
crash that could not bind its address (`[Errno 99] Cannot assign requested address`, or a bind
failure in the server's own words naming an address) on this host just now, the address the
server was told to listen on when this host does not have it; an address this host has leaves a
bind failure to the port's evidence.
`address_verdict` then makes the crash fatal with the address in its captures: the policy halts
it, and the quarantine record keeps the address (supervisor.actions.evidence) so the halt lifts
by itself once the address is there (the gate at a start, the recheck timer on a schedule): a
hold until the address exists, never a halt for good. `triage` reads no live host: it never
gathers this evidence.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from ..config import Config
from ..environment.addresses import bind_address, could_not_bind, is_local
from ..model import Basis, Confidence, Ended, Evidence, JournalEntry, Severity, Verdict
from .port_evidence import crash_here_now


class AddressEvidence:
    """The daemon's hook: the listen address a crash could not bind, when this host lacks it."""

    def __init__(
        self,
        config: Config,
        *,
        machine_id: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._machine_id = machine_id
        self._clock = clock

    def entries(self, batch: list[JournalEntry]) -> list[JournalEntry]:
        """Nothing to note while reading: entries pass unchanged."""
        return batch

    def reconfigure(self, config: Config) -> None:
        self.config = config

    async def evidence(self, ended: Ended, evidence: Evidence) -> Evidence:
        """The evidence with the address the crash could not bind, when this host lacks it
        now; unchanged for any other crash, another host's or an old one."""
        inv = ended.invocation
        cause = ended.reading.root_cause
        if not could_not_bind(cause) or evidence.phase.served:
            return evidence
        if not crash_here_now(inv, self._clock(), self.config, self._machine_id):
            return evidence
        address = bind_address(cause, (line.text for line in inv.lines))
        if address is None or await asyncio.to_thread(is_local, address) is not False:
            return evidence
        return dataclasses.replace(evidence, address=address)


def address_verdict(verdict: Verdict, address: str | None, *, halt_inferred: bool) -> Verdict:
    """The verdict as a missing listen address makes it: fatal until the address exists (the
    halt lifts by itself then), unless `halt_inferred` is off. Part of building the verdict."""
    if address is None:
        return verdict
    note = f"listen address {address} is not on this host"
    if not halt_inferred:
        return dataclasses.replace(verdict, notes=(*verdict.notes, note))
    return dataclasses.replace(
        verdict,
        severity=Severity.FATAL,
        basis=Basis.INFERRED,
        confidence=Confidence.HIGH,
        severity_reason=f"{note} (yet): every start fails to bind it until it is; the unit is "
        "held and starts by itself once the address exists",
        notes=(*verdict.notes, note),
        captures={**verdict.captures, "address": address},
    )
