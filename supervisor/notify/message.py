"""The Slack message for a crash: an `Outcome` in, a Block Kit payload out.

`build_payload` is pure, with a plain `text` fallback. Every piece of journal text is escaped
(`& < >`), so a log line cannot ping `<!channel>` or forge a link, and every block stays within
Slack's size limits (cut with a visible marker).

A held start (pacing: a crash loop not proven fatal) says it is paced, when the next start
comes, after how many crashes, on what evidence, what to check and how to start it now. Only the
hold that begins pacing is sent (supervisor.notify.decision); the later ones are in history.
"""

from __future__ import annotations

from typing import Any

from ..model import Confidence, Outcome, Rule, Taken, duration
from ..story import NO_ROOT_CAUSE, told_outcome
from ..util.when import utc
from .decision import Group

SECTION_LIMIT = 3000  # Slack: a section's text, a context element
FIELD_LIMIT = 2000  # Slack: one section field
HEADER_LIMIT = 150  # Slack: a header block's plain_text
FALLBACK_LIMIT = 3000  # our own bound for the top-level `text`
TRUNCATED = "… [truncated]"
EVIDENCE_LIMIT = 300  # characters of the root cause repeated as a hold's evidence
NO_CAUSE_NAMED = "no error line names the cause"
HOLD_TIMERS = "systemctl list-timers 'vllm-supervisor-hold-*'"


# -- the message ---------------------------------------------------------------------------------


def escape(text: str) -> str:
    """Escape Slack's control characters so text can never become a mention or a link."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def truncate(text: str, limit: int) -> str:
    """Cut already-escaped text to `limit` characters, marking the cut, never inside `&..;`."""
    if len(text) <= limit:
        return text
    cut = text[: max(0, limit - len(TRUNCATED))]
    amp = cut.rfind("&", max(0, len(cut) - 5))
    if amp != -1 and ";" not in cut[amp:]:
        cut = cut[:amp]
    return cut + TRUNCATED


def _code(text: str) -> str:
    """Escaped text inside a code block; a ``` in the text would end the block early."""
    return "```" + escape(text.replace("```", "`\u200b``")) + "```"


def _section(title: str, body: str) -> dict[str, Any]:
    text = truncate(f"*{title}*\n{body}", SECTION_LIMIT)
    return {"type": "section", "text": {"type": "mrkdwn", "text": text}}


def _field(title: str, body: str) -> dict[str, str]:
    return {"type": "mrkdwn", "text": truncate(f"*{title}*\n{body}", FIELD_LIMIT)}


# Slack's own mark for what was done; the words are the shared story's (supervisor.story).
_EMOJI = {
    Taken.HALTED: ":octagonal_sign:",
    Taken.QUARANTINED: ":octagonal_sign:",
    Taken.HALT_FAILED: ":rotating_light:",
    Taken.WOULD_HALT: ":warning:",
    Taken.HELD: ":hourglass_flowing_sand:",
    Taken.RESTARTING: ":repeat:",
    Taken.RESTARTED: ":repeat:",
    Taken.RESTART_FAILED: ":rotating_light:",
    Taken.DOWN: ":red_circle:",
    Taken.RECORDED: ":scroll:",
    Taken.OBSERVED: ":eyes:",
}


def _action_line(outcome: Outcome, unit: str) -> str:
    """What was decided and done, and how a person undoes a halt or starts a held unit now."""
    line = f"{_EMOJI.get(outcome.taken, ':grey_question:')} {escape(told_outcome(outcome))}"
    if outcome.taken in (Taken.HALTED, Taken.QUARANTINED):
        line += f". After fixing the cause, release it: `vllm-supervisor release {escape(unit)}`"
    elif outcome.taken is Taken.HELD:
        line += f". To start it now: `vllm-supervisor release {escape(unit)}`"
    return line


def _next_start(outcome: Outcome) -> str:
    """When a held start comes: its delay counted from the crash's end (the daemon holds it
    from its decision, moments later, so the time is "about")."""
    pace = outcome.decision.pace
    if pace is None:
        return "when its hold ends"
    after = f"{duration(pace.delay_s)} after this crash"
    ended = outcome.invocation.ended_us
    if ended is None:
        return after
    when = _utc(ended + pace.delay_s * 1_000_000, "%H:%M UTC", per_second=1_000_000)
    return after if when == "unknown" else f"at about {when} ({after})"


def _paced(outcome: Outcome) -> str:
    """The sentence of a held start: when the next start comes, after how many crashes."""
    pace = outcome.decision.pace
    in_a_row = ""
    if pace is not None:
        crashes = f"{pace.crashes} crash{'' if pace.crashes == 1 else 'es'}"
        in_a_row = f", after {crashes} in a row, each soon after its start"
    return (
        f"The next start comes {_next_start(outcome)}{in_a_row}. Each further crash doubles "
        "the wait; a start that runs the unit's `pace_reset_s` ends it."
    )


def _evidence(outcome: Outcome) -> str:
    """What the hold rests on: the root cause, or that no error line names one (a guess, a
    wrapper, a warning: the classifier's low confidence), and the rule that let it restart."""
    verdict = outcome.verdict
    rule = outcome.decision.rule
    named = (
        verdict.root_cause
        and verdict.confidence is not Confidence.LOW
        and rule is not Rule.UNKNOWN_NO_CAUSE
    )
    cause = truncate(verdict.root_cause or "", EVIDENCE_LIMIT) if named else NO_CAUSE_NAMED
    return f"{cause} (rule {rule.value}: not proven fatal, so not halted)"


def _pace_lines(outcome: Outcome) -> list[str]:
    """A held start, in plain words: nothing for any other outcome."""
    if outcome.taken is not Taken.HELD:
        return []
    unit = outcome.invocation.unit or "UNIT"
    return [
        f"Paced, not halted. {_paced(outcome)}",
        f"Evidence: {_evidence(outcome)}",
        f"Check: vllm-supervisor status {unit}; {HOLD_TIMERS}; journalctl -u {unit}",
    ]


def _pace_section(outcome: Outcome) -> dict[str, Any]:
    """The Paced section of a held start's message, its commands as code."""
    unit = outcome.invocation.unit or "UNIT"
    body = [
        escape(_paced(outcome)),
        f"Evidence: {escape(_evidence(outcome))}",
        f"Check: `vllm-supervisor status {escape(unit)}`, `{escape(HOLD_TIMERS)}`, "
        f"`journalctl -u {escape(unit)}`",
    ]
    return _section("Paced", "\n".join(body))


def _group_line(group: Group) -> str:
    start = _utc(group.first, "%H:%M")
    end = _utc(group.last, "%H:%M UTC")
    minutes = max(1, round(group.interval_s / 60))
    return (
        f"{group.count} crash{'es' if group.count != 1 else ''} of this kind between {start} "
        f"and {end} (grouped per {minutes} min)"
    )


def _crash_site(outcome: Outcome) -> str | None:
    site, cause = outcome.verdict.crash_site, outcome.verdict.root_cause
    if not site or (cause and site in cause):
        return None
    return site


def _header(outcome: Outcome, host: str, group: Group | None) -> str:
    unit = outcome.invocation.unit or "unknown unit"
    if outcome.taken is Taken.RECORDED and group is not None and group.count > 1:
        title = f"{group.count} past crashes read late"
    else:
        title = outcome.verdict.title
    return truncate(escape(f"{title} — {unit} on {_host(outcome, host)}"), HEADER_LIMIT)


def _host(outcome: Outcome, host: str) -> str:
    """The host the invocation ran on (a journal directory may hold another's)."""
    return outcome.invocation.hostname or host


def _when(outcome: Outcome) -> str:
    """When it ended, UTC, to the second."""
    ended = outcome.invocation.ended_us
    if ended is None:
        return "unknown"
    return _utc(ended, "%Y-%m-%d %H:%M:%S UTC", per_second=1_000_000)


def _utc(value: float, form: str, *, per_second: int = 1) -> str:
    """A time read from the journal, which may lie beyond what a datetime can hold (a clock
    set to the year 300000 stamps its entries so)."""
    when = utc(value, per_second=per_second)
    return "unknown" if when is None else when.strftime(form)


def _fields(outcome: Outcome, host: str) -> list[dict[str, str]]:
    verdict, inv = outcome.verdict, outcome.invocation
    signature = verdict.signature or f"unknown (fingerprint {verdict.fingerprint or 'none'})"
    restarts = "unknown" if inv.restarts is None else str(inv.restarts)
    return [
        _field("Host", escape(_host(outcome, host))),
        _field("Unit", escape(inv.unit or "unknown")),
        _field("Signature", escape(signature)),
        _field("Severity", escape(verdict.severity.value)),
        _field("Ended", escape(_when(outcome))),
        _field("Invocation", escape(inv.invocation_id or "unknown")),
        _field("Restarts", restarts),
        _field("Exit", escape(_exit_text(outcome))),
    ]


def _exit_text(outcome: Outcome) -> str:
    inv = outcome.invocation
    parts = [p for p in (inv.exit_code, inv.result) if p]
    if inv.exit_status is not None:
        parts.append(f"status {inv.exit_status}")
    if inv.oom_killed:
        parts.append("OOM-killed")
    if inv.hung:
        parts.append("engine hung")
    return ", ".join(parts) or "unknown"


def _blocks(
    outcome: Outcome, host: str, action: Taken, group: Group | None
) -> list[dict[str, Any]]:
    verdict, unit = outcome.verdict, outcome.invocation.unit or "unknown"
    header = _header(outcome, host, group)
    blocks: list[dict[str, Any]] = [
        {"type": "header", "text": {"type": "plain_text", "text": header}},
        {"type": "section", "fields": _fields(outcome, host)},
        _section("Root cause", _code(verdict.root_cause or NO_ROOT_CAUSE)),
    ]
    site = _crash_site(outcome)
    if site:
        blocks.append(_section("Crash site", _code(site)))
    if verdict.remediation:
        blocks.append(_section("Remediation", escape(verdict.remediation)))
    if outcome.drift:
        changed = escape("; ".join(outcome.drift))
        blocks.append(_section("Changed since the last good start", changed))
    if group is not None and group.count > 1:
        blocks.append(_section("Grouped", escape(_group_line(group))))
    if verdict.notes:
        blocks.append(_section("Notes", escape("; ".join(verdict.notes))))
    if outcome.taken is Taken.HELD:
        blocks.append(_pace_section(outcome))
    blocks.append(_section("Action", _action_line(outcome, unit) + escape(_loop_length(outcome))))
    blocks.append(_section("Full log", _code(_log_command(outcome))))
    said = f"Decision: {outcome.decision.reason}"
    if outcome.taken_detail:
        said += f". Done: {outcome.taken_detail}"
    reason = truncate(escape(said), SECTION_LIMIT)
    blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": reason}]})
    return blocks


def _loop_length(outcome: Outcome) -> str:
    """How long the loop ran before the halt: systemd's restart counter of the crash, + 1."""
    restarts = outcome.invocation.restarts
    if outcome.taken not in (Taken.HALTED, Taken.QUARANTINED) or restarts is None:
        return ""
    crashes = restarts + 1
    return f" (after {crashes} crash{'es' if crashes != 1 else ''} in a row)"


def _log_command(outcome: Outcome) -> str:
    """The command that shows the invocation's whole log."""
    inv = outcome.invocation
    unit = inv.unit or "UNIT"
    if inv.invocation_id:
        return f"journalctl -u {unit} _SYSTEMD_INVOCATION_ID={inv.invocation_id}"
    return f"journalctl -u {unit}"


def _fallback(outcome: Outcome, host: str, action: Taken, group: Group | None) -> str:
    """The plain `text`: what notifications and clients without Block Kit show."""
    verdict, unit = outcome.verdict, outcome.invocation.unit or "unknown"
    restarts = outcome.invocation.restarts
    lines = [
        f"{_header(outcome, host, group)} ({verdict.severity.value}, "
        f"restarts: {'unknown' if restarts is None else restarts})",
        f"Ended {_when(outcome)}, invocation {outcome.invocation.invocation_id or 'unknown'}",
        f"Root cause: {verdict.root_cause or NO_ROOT_CAUSE}",
    ]
    if outcome.invocation.hung:
        lines.append(
            "Engine hung: it logged its death and the unit stayed up past the grace period"
        )
    if outcome.drift:
        lines.append(f"Changed since the last good start: {'; '.join(outcome.drift)}")
    if group is not None and group.count > 1:
        lines.append(_group_line(group))
    lines.append(f"Action: {told_outcome(outcome)}{_loop_length(outcome)}")
    lines += _pace_lines(outcome)
    if action in (Taken.HALTED, Taken.QUARANTINED):
        lines.append(f"Release: vllm-supervisor release {unit}")
    elif action is Taken.HELD:
        lines.append(f"Start it now: vllm-supervisor release {unit}")
    lines.append(f"Log: {_log_command(outcome)}")
    return truncate(escape("\n".join(lines)), FALLBACK_LIMIT)


REPEAT_NOTE = (
    "Sent again: the supervisor restarted while sending this message, so Slack may already "
    "have shown it once."
)


def _serving_again(outcome: Outcome, host: str) -> dict[str, Any]:
    """The message that ends a paced loop's story: the unit serves again (no crash)."""
    unit = outcome.invocation.unit or "unknown"
    header = truncate(
        escape(f":white_check_mark: {unit} serves again on {_host(outcome, host)}"), HEADER_LIMIT
    )
    said = f"Since {_when(outcome)}: {outcome.decision.reason}."
    return {
        "text": truncate(
            escape(f"{unit} serves again on {_host(outcome, host)}. {said}"), FALLBACK_LIMIT
        ),
        "blocks": [
            {"type": "header", "text": {"type": "plain_text", "text": header}},
            _section("Pacing ended", truncate(escape(said), SECTION_LIMIT)),
        ],
    }


def as_repeat(payload: dict[str, Any]) -> dict[str, Any]:
    """A queued message that may have gone out already, marked so at its top."""
    if not isinstance(payload, dict):
        return payload
    note = {"type": "context", "elements": [{"type": "mrkdwn", "text": REPEAT_NOTE}]}
    blocks = payload.get("blocks")
    return {
        **payload,
        "text": f"(repeat) {payload.get('text', '')}",
        "blocks": [note, *blocks] if isinstance(blocks, list) else [note],
    }


def build_payload(outcome: Outcome, *, host: str, group: Group | None = None) -> dict[str, Any]:
    """The webhook body for one crash (or a group of transient or late ones); pure."""
    if outcome.decision.rule is Rule.SERVING_AGAIN:
        return _serving_again(outcome, host)
    action = outcome.taken
    return {
        "text": _fallback(outcome, host, action, group),
        "blocks": _blocks(outcome, host, action, group),
    }
