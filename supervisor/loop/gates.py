"""Answering the served units' gates: a start waits until its unit's past is decided and done.

A served unit's `ExecCondition=` gate (supervisor.actions.gatekeeper) asks before each start;
the answer comes once the journal is read up to the gate's own start (its invocation id, from
PID 1's "Starting"), no ended invocation of the unit waits for its late lines, and the unit's
lane has carried out what was decided (its quarantine record is written). Another unit's
actions are never waited for. The gate itself then reads the records: it fails closed only on
a quarantine record.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ..actions.lanes import Lanes
from ..actions.unitnames import RealNames
from ..pipeline import Pipeline
from ..seams import JournalSource
from ..util.aio import first_of

GATE_KICK_S = 0.01  # while a gate waits for its start to be read, the reader looks this often


class GateService:
    """Answers gates from what the pipeline has read and decided and the lanes have done."""

    def __init__(
        self, pipeline: Pipeline, reader: JournalSource, lanes: Lanes[Any], names: RealNames
    ) -> None:
        self._pipeline = pipeline
        self._reader = reader
        self._lanes = lanes
        self._names = names
        self._progress = asyncio.Event()  # replaced (after being set) at each handled batch

    def progressed(self) -> None:
        """The journal was read further (a batch was handled): wake the gates waiting."""
        progress, self._progress = self._progress, asyncio.Event()
        progress.set()

    async def answer(self, unit: str, invocation_id: str | None, wait_s: float) -> dict[str, Any]:
        """Answer a gate once `unit`'s past is decided and acted on, or `wait_s` passed.
        `unit` may be any name of a supervised unit (the gate's %n is its real name)."""
        unit = self._names.real_name(unit)
        if not self._pipeline.supervises(unit):
            # A drop-in left on a unit the config no longer names: nothing will decide about
            # it, so waiting would only delay its start by `wait_s`.
            return {"ok": True, "decided": True, "supervised": False}
        deadline = time.monotonic() + wait_s
        while invocation_id is not None and not self._pipeline.has_seen(unit, invocation_id):
            if not await self._progress_until(deadline, kick=True):
                return {"ok": True, "decided": False, "waited": "start not read in time"}
        while self._pipeline.settling(unit):
            if not await self._progress_until(deadline, kick=False):
                return {"ok": True, "decided": False, "waited": "previous run not decided"}
        await first_of(self._lanes.idle(unit), at_most_s=max(0.0, deadline - time.monotonic()))
        if self._lanes.pending(unit):
            return {"ok": True, "decided": False, "waited": "its action not carried out in time"}
        return {"ok": True, "decided": True}

    async def _progress_until(self, deadline: float, *, kick: bool) -> bool:
        """Wait for the next handled batch (with `kick`, asking the reader to look now, again
        every GATE_KICK_S); False once `deadline` (monotonic) has passed."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if kick:
            self._reader.kick()
            remaining = min(remaining, GATE_KICK_S)
        await first_of(self._progress.wait(), at_most_s=remaining)
        return True
