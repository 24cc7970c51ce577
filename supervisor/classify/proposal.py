"""A signature proposed from a recorded crash (`vllm-supervisor signatures propose`).

An unknown crash that loops is halted only after it repeats: every host pays its restarts
again. The operator who read the crash knows it now; one command turns the daemon's record of
it into a reviewed `[[signature]]`: the root cause's line with its variable parts (numbers,
quoted names, paths, hex ids) generalised, its severity from the evidence the record keeps, the
line itself as the signature's `examples` (checked at every load), and `written_from` naming
the invocation. Reloaded, the next start of the same crash is halted at its first crash.

A root cause the classifier only guessed (no error line named it), a crash a signature already
knows, or a line with too little fixed text is refused in one line: a signature from it would
match the wrong lines.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_EXAMPLE_CHARS = 1000
MAX_PATTERN_SOURCE = 200  # the start of the line names the crash; the rest is detail
MIN_FIXED_CHARS = 12  # word characters the pattern must keep besides the exception's class

# The parts of a line that change from one crash of the same kind to the next.
_VARIABLE = re.compile(
    r"(?P<quoted>'[^'\n]{0,300}'|\"[^\"\n]{0,300}\")"
    r"|(?P<path>(?<![\w/.])/[^\s'\",:;()\[\]{}]+)"
    r"|(?P<hex>\b0x[0-9a-fA-F]+\b|\b(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{8,}\b)"
    r"|(?P<number>\d+(?:\.\d+)*)",
    re.ASCII,  # as RE2 reads \d, \w and \b: ASCII digits and letters only
)
_GENERAL = {
    "path": r"/[^\s'\",:;()\[\]{}]+",
    "hex": r"(?:0x)?[0-9a-fA-F]+",
    "number": r"\d+(?:\.\d+)*",
}
_SPECIAL = frozenset(r"\.^$|?*+()[]{}")
_CLASS = re.compile(r"((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Failure))\b")
_WORD = re.compile(r"\w")
_GUESS_NOTE = "(a guess)"


@dataclass(frozen=True, slots=True)
class Proposal:
    """A ready-to-review signature: its id and its TOML text."""

    id: str
    toml: str


class Refused(ValueError):
    """Why no signature is proposed from that crash, in one line."""


def literal(text: str) -> str:
    """`text` as an RE2 regex that matches exactly it."""
    return "".join("\\" + c if c in _SPECIAL else c for c in text)


def generalised_pattern(text: str) -> str:
    """A regex matching `text` and the same line with other numbers, quoted names, paths and
    hex ids: the start of the line (up to MAX_PATTERN_SOURCE characters, cut at a space)."""
    source = _head(text)
    parts: list[str] = []
    at = 0
    for found in _VARIABLE.finditer(source):
        parts.append(literal(source[at : found.start()]))
        kind = found.lastgroup or "number"
        if kind == "quoted":
            quote = found.group()[0]
            parts.append(f"{quote}[^{quote}]*{quote}")
        else:
            parts.append(_GENERAL[kind])
        at = found.end()
    parts.append(literal(source[at:]))
    return "".join(parts)


def fixed_chars(text: str) -> int:
    """Word characters of the line's head the pattern keeps as they are (its class aside)."""
    source = _head(text)
    kept = _VARIABLE.sub("", source)
    found = _CLASS.match(kept.strip())
    if found is not None:
        kept = kept.strip()[found.end() :]
    return len(_WORD.findall(kept))


def propose(item: Mapping[str, Any]) -> Proposal:
    """The signature for one recorded invocation (an item of `Store.history`); Refused when
    its record cannot make a good one."""
    verdict = _mapping(item.get("verdict"))
    decision = _mapping(item.get("decision"))
    unit, invocation = str(item.get("unit") or ""), str(item.get("invocation_id") or "")
    cause = verdict.get("root_cause")
    if not isinstance(cause, str) or not cause.strip():
        raise Refused(f"{unit} {invocation}: no root cause was recorded")
    cause = cause.strip()
    if isinstance(verdict.get("signature"), str):
        raise Refused(f"{unit} {invocation}: already known as signature {verdict['signature']}")
    notes = [str(n) for n in verdict.get("notes") or []]
    if verdict.get("confidence") == "low" or any(_GUESS_NOTE in n for n in notes):
        raise Refused(
            f"{unit} {invocation}: its root cause is a guess (no error line names it): a "
            "signature written from it would match the wrong lines"
        )
    if fixed_chars(cause) < MIN_FIXED_CHARS:
        raise Refused(
            f"{unit} {invocation}: its root cause keeps too little fixed text once its "
            f"numbers, names and paths are generalised: {cause[:120]!r}"
        )
    pattern = generalised_pattern(cause)
    example = cause[:MAX_EXAMPLE_CHARS]
    fingerprint = str(verdict.get("fingerprint") or hashlib.sha256(cause.encode()).hexdigest())
    found = _CLASS.match(cause)
    kind = (found.group(1).rsplit(".", 1)[-1] if found else "crash").lower()
    sig_id = f"local_{re.sub(r'[^a-z0-9]+', '_', kind).strip('_')}_{fingerprint[:8]}"
    severity, serving, why = _severity(verdict, decision, item)
    lines = [
        "[[signature]]",
        f"id = {_string(sig_id)}",
        f"title = {_string('Proposed: ' + _head(cause, 80))}",
        f"severity = {_string(severity)}",
        *([f"serving_severity = {_string(serving)}"] if serving else []),
        f"patterns = [{_string(pattern)}]",
        f"examples = [{_string(example)}]",
        "remediation = "
        + _string("Written from a recorded crash: say what fixes it (a package, a setting)."),
        f"written_from = [{{ invocation = {_string(f'{unit} {invocation}')} }}]",
        "notes = "
        + _string(
            f"Proposed by `vllm-supervisor signatures propose` from {unit} {invocation} "
            f"({item.get('time') or 'time unknown'}). Severity: {why}. Review the pattern "
            "and the severity before relying on it."
        ),
    ]
    return Proposal(sig_id, "\n".join(lines) + "\n")


def _severity(
    verdict: Mapping[str, Any], decision: Mapping[str, Any], item: Mapping[str, Any]
) -> tuple[str, str | None, str]:
    """(severity, serving_severity or None, why) from what the record says. A fatal
    signature still restarts a start that served long (the policy's fatal_after_serving);
    after serving it stays unknown only when the record itself did not prove the repeat."""
    reason = str(verdict.get("severity_reason") or "")
    rule = str(decision.get("rule") or "")
    if verdict.get("leaning") == "transient" or "leans indeterminate" in reason:
        return "transient", None, "its evidence leans transient (" + reason[:160] + ")"
    said = f"the daemon's rule {rule}" if rule else "no rule recorded"
    if not item.get("served"):
        return "fatal", None, f"{said}; it crashed before the server ever served"
    if decision.get("action") == "halt":
        return "fatal", None, f"{said}: it repeated right after serving"
    return "fatal", "unknown", f"{said}; it crashed after serving: there it stays unknown"


def _head(text: str, limit: int = MAX_PATTERN_SOURCE) -> str:
    """The first line of `text`, cut at a space before `limit` characters."""
    first = text.strip().splitlines()[0] if text.strip() else ""
    if len(first) <= limit:
        return first
    cut = first.rfind(" ", 0, limit)
    return first[: cut if cut > limit // 2 else limit]


def _string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, and TOML escapes DEL too."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}
