"""Is systemd bringing the supervisor back? The gate's question when no daemon answers.

A gate that finds no daemon lets the start go: a missing supervisor must not take the server
down. But "missing" is often a moment: `systemctl restart vllm-supervisor`, a crash or a kill
restarted by `Restart=on-failure`, a frozen loop killed by the watchdog. A fatal crash that ends
in that moment would be started again, at `RestartSec=100ms` several times, before the new
daemon reads it. So the gate asks systemd about the supervisor's own unit and waits (bounded)
while a start is on its way; a stopped or failed supervisor that nothing restarts is not waited
for.

Checked on systemd 252: `systemctl restart` shows a "restart" job through its stop and its
start; after a kill the unit waits in `activating/auto-restart` with no job, then a "restart"
job starts it; after the watchdog's kill the unit goes down on its own (`deactivating`,
`stop-watchdog` then `stop-post`, no job) into `auto-restart`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..actions.systemd import SystemdClient, ask_once
from ..config import SUPERVISOR_UNIT
from ..errors import SystemdError
from ..model import UnitState
from ..util.jsontext import whole_number

SYSTEMD_TIMEOUT_S = 2.0

# Jobs that end with the unit started; a "stop" job (someone stopped it) does not.
_STARTING_JOBS = frozenset({"start", "restart", "try-restart", "reload-or-start", "verify-active"})


@dataclass(frozen=True, slots=True)
class SupervisorUnit:
    """What systemd says of the supervisor's unit: its state, pending job, and how long ago it
    stopped being active (None: it never was, in this boot)."""

    state: UnitState
    job: str  # "" when none
    inactive_for_s: float | None


def coming_back(unit: SupervisorUnit, *, within_s: float) -> str | None:
    """Why systemd is bringing the supervisor back now, or None when nothing does.

    Only a supervisor that was up until `within_s` ago counts: one that never came up (a start
    at boot) or that keeps failing to (a crash loop, a missing credential) is not waited for,
    or every start of every served unit would wait for it in vain.
    """
    state, job = unit.state, unit.job
    if job and job not in _STARTING_JOBS:
        return None  # a stop (or another job) that leaves it down
    if state.active_state in ("active", "reloading"):
        return f"systemd is running a {job} job of it" if job else None
    if unit.inactive_for_s is None or unit.inactive_for_s > within_s:
        return None
    if job:
        return f"systemd is running a {job} job of it ({state.active_state}/{state.sub_state})"
    if state.sub_state == "auto-restart":
        return f"systemd restarts it after a failure ({state.active_state}/{state.sub_state})"
    if state.active_state == "activating":
        return f"it is starting ({state.sub_state})"
    if state.active_state == "deactivating":
        # Going down with no stop job: it died or the watchdog killed it, and systemd
        # restarts it if Restart= says so. Asked again each second, so a unit that ends
        # failed instead is waited for no longer than that.
        return f"it is going down on its own ({state.sub_state}); Restart= may bring it back"
    return None


def ask_about(unit: str = SUPERVISOR_UNIT) -> SupervisorUnit | None:
    """systemd's view of the supervisor's unit; None when systemd cannot be asked."""

    async def question(client: SystemdClient) -> SupervisorUnit:
        state = await client.unit_state(unit)
        job = await client.pending_job(unit)
        left = await client.unit_property(unit, "ActiveExitTimestampMonotonic")
        # systemd's t (microseconds); anything else says nothing of when it went down.
        left_us = whole_number(left)
        now_us = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return SupervisorUnit(state, job, (now_us - left_us) / 1e6 if left_us else None)

    try:
        return ask_once(question, timeout_s=SYSTEMD_TIMEOUT_S)
    except (SystemdError, OSError, TimeoutError):
        return None
