"""Whether and how a crash is told: the pure decision before any message is built.

`telling` returns a `NotifyReason`, as Alertmanager's dedup stage (`needsUpdate`) returns a
`NotifyReason`: the outbox queues, holds or drops by it and nothing else. Transient crashes of
one unit and signature are folded into one message per group interval (`Group`, keyed by
`group_key`); crashes read late, one summary per unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ..actions.evidence import evidence_of
from ..fleet import proof_of_halt
from ..model import ENDINGS, Action, News, Outcome, Rule, Severity, Taken


@dataclass(frozen=True, slots=True, kw_only=True)
class Group:
    """Transient crashes of one unit+signature folded into one message."""

    count: int
    first: float  # unix time of the first crash in the group
    last: float  # unix time of the latest
    interval_s: float  # the grouping interval


def is_notable(outcome: Outcome) -> bool:
    """True for an invocation worth a message: systemd saw a failure or the lines show a crash,
    or systemd gave up restarting it; never a person's stop or a skipped start."""
    news = ENDINGS[outcome.invocation.ending].news  # the model's one table of endings
    if news is not News.IF_CRASHED:
        return news is News.ALWAYS
    return outcome.invocation.failed or outcome.verdict.crashed


def group_key(outcome: Outcome) -> str | None:
    """Messages folded together: crashes read late, one summary per unit; transient crashes per
    unit and signature. Fatal, unknown and acted-on crashes are never folded."""
    unit = outcome.invocation.unit
    if outcome.taken is Taken.RECORDED:
        return f"{unit}\x00backlog"
    transient = (
        outcome.verdict.severity is Severity.TRANSIENT
        and outcome.verdict.signature is not None
        and outcome.decision.action is not Action.HALT
    )
    return f"{unit}\x00{outcome.verdict.signature}" if transient else None


def is_backlog(key: str | None) -> bool:
    """True for the group of crashes read late."""
    return key is not None and key.endswith("\x00backlog")


class NotifyReason(StrEnum):
    """Why a crash is, or is not, told."""

    OFF = "off"  # no endpoint configured
    NOT_NEWS = "not_news"  # a person's stop, a skipped start, a reboot, a clean exit
    MUTED = "muted"  # a transient crash while `slack.notify_transient` is off
    ALONE = "alone"  # its own message, at once: fatal, unknown, acted on
    GROUPED = "grouped"  # folded with the transient crashes of its unit and signature
    BACKLOG = "backlog"  # read late: folded into the unit's summary of its backlog
    FOLDED = "folded"  # a crash while the unit's halt stood: that halt's message told it
    PACED = "paced"  # a crash of a loop already paced: the message that began pacing told it
    ELSEWHERE = "elsewhere"  # another host's crash in a shared journal: its own daemon tells it
    # A halt the fleet shares, with [fleet] share on: the fleet's Alertmanager group tells the
    # rollout once, naming the hosts (deploy/alertmanager), not each host's webhook.
    FLEET = "fleet"

    @property
    def tells(self) -> bool:
        """True when the crash goes into a message."""
        return self in (NotifyReason.ALONE, NotifyReason.GROUPED, NotifyReason.BACKLOG)


def telling(
    outcome: Outcome, *, endpoint: bool, notify_transient: bool, fleet_tells: bool = False
) -> NotifyReason:
    """Whether and how `outcome` is told; `fleet_tells` when halts the fleet shares go to its
    Alertmanager ([fleet] share with an [alertmanager] url)."""
    if not endpoint:
        return NotifyReason.OFF
    if outcome.decision.rule is Rule.SERVING_AGAIN:
        return NotifyReason.ALONE  # the end of a paced loop's story: no crash, still news
    if not is_notable(outcome):
        return NotifyReason.NOT_NEWS
    if outcome.decision.rule is Rule.OTHER_HOST:
        return NotifyReason.ELSEWHERE  # one host, one voice: recorded here, told there
    halted = outcome.taken in (Taken.HALTED, Taken.QUARANTINED)
    if outcome.already_halted_by is not None and halted:
        return NotifyReason.FOLDED  # a halt that failed is news, whatever stood before
    if halted and fleet_tells and _fleet_tells_it(outcome):
        return NotifyReason.FLEET  # one message per rollout, naming the hosts, not per host
    pace = outcome.decision.pace
    if outcome.taken is Taken.HELD and pace is not None:
        # One message when pacing begins (a transient loop's too), never one per crash.
        return NotifyReason.ALONE if pace.first else NotifyReason.PACED
    key = group_key(outcome)
    if key is None:
        return NotifyReason.ALONE
    if is_backlog(key):
        return NotifyReason.BACKLOG
    return NotifyReason.GROUPED if notify_transient else NotifyReason.MUTED


def _fleet_tells_it(outcome: Outcome) -> bool:
    """The halt has a fleet alert to tell it: a rule the fleet shares, on no evidence of the
    host's own state, and a crash fingerprint to group by."""
    rule, evidence = outcome.decision.rule.value, evidence_of(outcome)
    return proof_of_halt(rule, evidence) is not None and bool(outcome.verdict.fingerprint)


def dedupe_key(outcome: Outcome) -> str | None:
    """What makes a crash unique among messages: its invocation id, else its last cursor."""
    inv = outcome.invocation
    return inv.invocation_id or (f"cursor:{inv.last_cursor}" if inv.last_cursor else None)
