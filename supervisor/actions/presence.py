"""Is an ended invocation the present one? The rule every halt and restart obeys.

A halt or a restart is for the invocation that is running or about to be restarted now. A crash
read late (a backlog after the supervisor's own downtime, a previous boot, another host's entries
in a journal directory, a newer invocation that a person or systemd started since) is history:
recorded and reported, never acted on. systemd is asked (D-Bus: `InvocationID`, `ActiveState`,
`SubState`, `NRestarts`); when it cannot answer, the journal alone decides, and only for a crash
that ended moments ago with nothing newer seen.

Checked on systemd 252: while a unit waits in `auto-restart`, `InvocationID` is still the ended
invocation's and `NRestarts` the count before it; the restart job increments `NRestarts` and a
new `InvocationID` comes with "Starting"; a person's `systemctl start` resets `NRestarts` to 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ..model import Invocation, UnitState


class Presence(StrEnum):
    """Where an ended invocation stands now."""

    CURRENT = "current"  # the unit still is this invocation: a restart pending, or still running
    RESTARTING = "restarting"  # systemd's automatic restart of it is starting right now
    DOWN = "down"  # it was the unit's last invocation and nothing restarts it
    LATE = "late"  # a newer invocation runs, or it ended too long ago: history
    OTHER_HOST = "other-host"  # another machine's entries (a journal directory of several)
    PREVIOUS_BOOT = "previous-boot"  # this host's earlier boot


ACTABLE = frozenset({Presence.CURRENT, Presence.RESTARTING})


@dataclass(frozen=True, slots=True, kw_only=True)
class Judgement:
    """The presence of one ended invocation and why; `confirmed` when systemd said so."""

    presence: Presence
    reason: str
    confirmed: bool
    running: bool = False  # the unit runs a process now (StopUnit or RestartUnit needed)
    gating: bool = False  # its next start's ExecCondition= (our gate) runs now or will
    # Active with no process left (RemainAfterExit=yes): systemd will not restart it.
    remains: bool = False

    @property
    def actable(self) -> bool:
        """True when a halt or restart may touch the unit now."""
        return self.presence in ACTABLE


@dataclass(frozen=True, slots=True, kw_only=True)
class Here:
    """What the daemon knows of this host and of what it read after the invocation."""

    machine_id: str  # this host's /etc/machine-id ("" when unknown)
    boot_id: str  # the running boot's id ("" when unknown)
    now_us: int  # wall clock, microseconds
    act_window_s: float  # a crash older than this with nothing confirming it is history
    newer_id: str | None = None  # the unit's newer invocation read in the journal, if any
    newer_served: bool = False  # ... and whether it logged that it serves


def judge(invocation: Invocation, state: UnitState | None, here: Here) -> Judgement:
    """The presence of `invocation`, from systemd's `state` (None: it could not be asked)."""
    if invocation.host and here.machine_id and invocation.host != here.machine_id:
        name = invocation.hostname or invocation.host
        return _history(Presence.OTHER_HOST, f"it ran on another host ({name})")
    if invocation.boot_id and here.boot_id and invocation.boot_id != here.boot_id:
        return _history(Presence.PREVIOUS_BOOT, "it ran in an earlier boot of this host")
    age_s = _age_s(invocation, here.now_us)
    if state is None:
        return _from_journal(invocation, here, age_s)
    if _is_its_end(invocation, state, here):
        if state.sub_state == "auto-restart":
            return Judgement(
                presence=Presence.CURRENT,
                reason="systemd is about to restart it (auto-restart)",
                confirmed=True,
                running=True,
                # Our gate runs first at that restart and refuses it: a StopUnit now could
                # land just as the restart's gate starts, and kill it.
                gating=state.gated,
            )
        if state.active_state == "active" and state.sub_state == "exited":
            return Judgement(
                presence=Presence.CURRENT,
                reason="its server exited, but the unit stays active/exited (RemainAfterExit=)",
                confirmed=True,
                running=True,
                remains=True,
            )
        if state.active_state in ("active", "activating", "reloading", "deactivating"):
            return Judgement(
                presence=Presence.CURRENT,
                reason=f"it still runs ({state.active_state}/{state.sub_state})",
                confirmed=True,
                running=True,
            )
        return Judgement(
            presence=Presence.DOWN,
            reason=f"it is the unit's last run and nothing restarts it "
            f"({state.active_state}/{state.sub_state})",
            confirmed=True,
        )
    if _is_its_automatic_restart(invocation, state, here, age_s):
        return Judgement(
            presence=Presence.RESTARTING,
            reason=f"systemd is restarting it automatically (restart {state.n_restarts}, "
            f"{state.active_state}/{state.sub_state})",
            confirmed=True,
            running=state.active_state in ("active", "activating"),
            gating=state.sub_state == "condition",
        )
    newer = state.invocation_id or "none"
    return _history(
        Presence.LATE,
        f"read late: the unit now runs a newer invocation ({newer}, "
        f"{state.active_state}/{state.sub_state}) that a person or systemd started",
        confirmed=True,
    )


def _is_its_end(invocation: Invocation, state: UnitState, here: Here) -> bool:
    """systemd still shows this invocation as the unit's last run.

    On systemd 252 a unit that ended "Deactivated successfully" (inactive/dead) reports no
    InvocationID at all: it is still this run's end when nothing newer started since.
    """
    if state.invocation_id == invocation.invocation_id:
        return True
    nothing_newer = here.newer_id in (None, invocation.invocation_id)
    return (
        state.invocation_id == "" and state.active_state in ("inactive", "failed") and nothing_newer
    )


def _is_its_automatic_restart(
    invocation: Invocation, state: UnitState, here: Here, age_s: float | None
) -> bool:
    """The unit's current invocation is systemd's restart of this one, not yet serving."""
    if state.active_state not in ("activating", "active") or here.newer_served:
        return False
    if age_s is not None and age_s > here.act_window_s:
        return False
    expected = invocation.restart_scheduled
    if expected is None:
        expected = (invocation.restarts or 0) + 1
    return state.n_restarts > 0 and state.n_restarts == expected


def _from_journal(invocation: Invocation, here: Here, age_s: float | None) -> Judgement:
    """Without systemd: act only on a crash that just ended with nothing newer started since
    (or only its own automatic restart, not serving)."""
    if age_s is not None and age_s > here.act_window_s:
        return _history(
            Presence.LATE, f"read late: it ended {age_s:.0f} s ago (systemd was not asked)"
        )
    if here.newer_id is not None and here.newer_id != invocation.invocation_id:
        if invocation.restart_scheduled is None or here.newer_served:
            return _history(
                Presence.LATE, "read late: a newer invocation started since (systemd was not asked)"
            )
        return Judgement(
            presence=Presence.RESTARTING,
            reason="the journal shows systemd restarting it (systemd was not asked)",
            confirmed=False,
            running=True,
        )
    return Judgement(
        presence=Presence.CURRENT,
        reason="it just ended and nothing newer started (systemd was not asked)",
        confirmed=False,
        running=True,
    )


def _history(presence: Presence, reason: str, *, confirmed: bool = False) -> Judgement:
    return Judgement(presence=presence, reason=reason, confirmed=confirmed)


def _age_s(invocation: Invocation, now_us: int) -> float | None:
    if invocation.ended_us is None:
        return None
    return max(0.0, (now_us - invocation.ended_us) / 1e6)
