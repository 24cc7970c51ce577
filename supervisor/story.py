"""One vocabulary for what was decided and done about an ended invocation, shared by every
renderer (history, triage, Slack, Alertmanager, the demo), so one event tells one story.

The words are the contract's own: a decision is `halt`, `hold`, `allow-restart` or `observe`
(`decision.action`); what was done is a `Taken` value (`halted`, `down`, ...). A line says
both when they differ ("allow-restart → down: ..."), and only what was done when it is what the
decision leads to. `triage` acts on nothing, so it says what the daemon would decide. A value
that is not known is said as `unknown`, never `None`.
"""

from __future__ import annotations

from .model import Action, Outcome, Taken

UNKNOWN = "unknown"
NO_ROOT_CAUSE = "no root-cause line found"

# What each `Taken` means, in one plain sentence (Slack adds its own emoji and markup).
DONE: dict[str, str] = {
    Taken.HALTED.value: "systemd will not restart it",
    Taken.QUARANTINED.value: "its gate refuses the next start, but systemd was not told",
    Taken.HALT_FAILED.value: "the quarantine could not be written; systemd may start it again",
    Taken.WOULD_HALT.value: "no action taken, it would have been halted",
    Taken.HELD.value: "its next start waits until the hold ends; systemd starts it then",
    Taken.RESTARTING.value: "systemd restarts it",
    Taken.RESTARTED.value: "restarted by the supervisor (systemd would not have)",
    Taken.RESTART_FAILED.value: "the restart failed; the server stays down",
    Taken.DOWN.value: "it crashed and nothing restarts it",
    Taken.RECORDED.value: "read late: recorded only, no action taken "
    "(it is not the unit's present run)",
    Taken.OBSERVED.value: "no action taken",
}

# What a decision leads to when carried out as decided (a dry run's halt included).
_LEADS_TO: dict[str, frozenset[str]] = {
    Action.HALT.value: frozenset({Taken.HALTED.value, Taken.WOULD_HALT.value}),
    Action.HOLD.value: frozenset({Taken.HELD.value, Taken.WOULD_HALT.value}),
    Action.ALLOW_RESTART.value: frozenset({Taken.RESTARTING.value}),
    Action.OBSERVE.value: frozenset({Taken.OBSERVED.value}),
}


def shown(value: object) -> str:
    """A value as a person reads it: `unknown` for a missing one."""
    return UNKNOWN if value is None or value == "" else str(value)


def told(action: str | None, taken: str | None) -> str:
    """What was decided and done, in the shared words: "halted: systemd will not restart
    it", "allow-restart → down: it crashed and nothing restarts it"."""
    if taken is None:
        return decided(action)
    sentence = DONE.get(taken, "")
    said = taken if taken in _LEADS_TO.get(action or "", ()) else f"{shown(action)} → {taken}"
    return f"{said}: {sentence}" if sentence else said


def decided(action: str | None) -> str:
    """A decision nobody acted on (triage): what the daemon would do."""
    return f"{shown(action)} (decided; nothing is done by triage)"


def told_outcome(outcome: Outcome) -> str:
    """`told` of an outcome the daemon acted on."""
    return told(outcome.decision.action.value, outcome.taken.value)
