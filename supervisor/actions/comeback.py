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

from dataclasses import dataclass

from ..actions.systemd import SystemdClient, ask_once
from ..config import SUPERVISOR_UNIT
from ..errors import SystemdError
from ..model import UnitState

SYSTEMD_TIMEOUT_S = 2.0

# Jobs that end with the unit started; a "stop" job (someone stopped it) does not.
_STARTING_JOBS = frozenset({"start", "restart", "try-restart", "reload-or-start", "verify-active"})


@dataclass(frozen=True, slots=True)
class SupervisorUnit:
    """What systemd says of the supervisor's unit: its state and pending job."""

    state: UnitState
    job: str  # "" when none


def coming_back(unit: SupervisorUnit) -> str | None:
    """Why systemd is (re)starting the supervisor now, or None when nothing brings it back."""
    state, job = unit.state, unit.job
    if job in _STARTING_JOBS:
        return f"systemd is running a {job} job of it ({state.active_state}/{state.sub_state})"
    if job:
        return None  # a stop (or another job) that leaves it down
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
        return SupervisorUnit(await client.unit_state(unit), await client.pending_job(unit))

    try:
        return ask_once(question, timeout_s=SYSTEMD_TIMEOUT_S)
    except (SystemdError, OSError, TimeoutError):
        return None
