"""Pacing: the delay before the next start of a unit whose starts keep crashing.

A crash loop the evidence does not prove fatal is not halted for good (a wrong halt costs an
outage), nor restarted at systemd's pace forever (about 100 starts in 5 minutes at
`RestartSec=1s`, each of them minutes of GPUs loading weights). From the 2nd crash in a row of
starts that each ended within `reset_s`, the next start is held for a delay that doubles with
each further crash, up to a cap, and comes back by itself (Kubernetes' CrashLoopBackOff, with
delays sized for models that load for minutes). A start that runs `reset_s` (10 minutes:
Kubernetes resets its back-off after 10 minutes of running too), serving or loading, ends the
run of crashes. The delay is this module's; the mechanism that holds the start is the actions'
(supervisor.actions.holds: the gate refuses, a systemd timer starts the unit at the deadline).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model import PACE_FIRST_CRASH, Phase

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """A unit's pacing settings (`[[unit]]` pace_first_s, pace_max_s, pace_reset_s)."""

    first_s: float = 60.0
    max_s: float = 3600.0
    reset_s: float = 600.0
    factor: float = 2.0

    def delay(self, crashes: int) -> float | None:
        """The hold before the next start after `crashes` crashes in a row; None: no hold."""
        if crashes < PACE_FIRST_CRASH:
            return None
        # Capped before the power grows past a float: a loop of a million crashes is capped too.
        steps = min(crashes - PACE_FIRST_CRASH, 64)
        return min(self.first_s * self.factor**steps, self.max_s)

    def ends_the_run(self, phase: Phase) -> bool:
        """True when this start ran `reset_s` (served or not): its crash starts a new count.
        A start that served a moment (the first request crashes it) is still a loop: a server
        that crashes 5 s after it serves restarted at systemd's pace all day before."""
        if phase.ran_s is not None:
            return phase.ran_s >= self.reset_s
        return phase.served  # its start unseen: that it served is all that is known

    def starts_per_day(self, run_s: float, restart_s: float) -> float:
        """How many starts a loop makes in a day under this schedule, each start running
        `run_s` before it crashes and systemd waiting `restart_s` before the next (the honest
        waste figure of bench.decisions)."""
        elapsed, starts = 0.0, 0
        while elapsed < SECONDS_PER_DAY:
            starts += 1
            delay = self.delay(starts)
            # The hold runs from the crash; systemd's own RestartSec= runs beside it.
            elapsed += run_s + max(restart_s, delay or 0.0)
            if delay == self.max_s:  # steady state: the rest of the day at the cap
                period = run_s + max(restart_s, self.max_s)
                return starts + max(0.0, SECONDS_PER_DAY - elapsed) / period
        return float(starts)
