"""Will the next start crash the same way? Evidence beside the signatures.

The signature table will never list every message. What generalises is what an engineer reads
in a crash no signature knows, each piece named in the verdict's `severity_reason`:

- *the phase*: did it ever serve (a serving line, requests handled, or it ran `good_start_s`)?
  A crash during startup repeats with the same config and packages; one after hours of serving
  is more likely load- or request-triggered, so after serving nothing is inferred fatal.
- *the words* of the cause (the lexicon, config/lexicon.toml, read by `lexicon.py`): "is not
  supported", "does not match", "cannot find", "out of memory" before serving say the same
  start meets it again; "timed out", "429 Too Many Requests", "Connection reset", "used by
  other processes" say the next may not. Read for any class, RuntimeError included, and for
  lines with no class; a wrapper's carried cause is read, not the wrapper.
- *the numbers* of a memory check: more wanted than the device has at all never fits; more
  than is free, but not than in all, means another process holds the rest.
- *the class*: an import error, a KeyError, a ValueError (deterministic) or a ConnectionError,
  a TimeoutError (not); RuntimeError, Exception and OSError say nothing either way.
- *the raise site*: the innermost frame's module or function (argument parsing, model and
  weight loading, kernel selection, a `_check_*` function, an import; or distributed, HTTP,
  hub code). A weak clue alone; before the server ever served, a deterministic site with no
  clue at all the other way settles fatal (`_loading_site`): a network, timeout or kill
  always leaves a clue of its own, so where and when agreeing is what is left.
- *the raise statement*: a traceback cut before its exception line still shows, in its
  innermost frame, the `raise ValueError("...")` that raised it (the classifier makes that
  line the cause; its class and words count as an exception line's).
- *how it ended*: the main process killed by SIGKILL or SIGTERM (`code=killed`, no stop job)
  was killed from outside, by a person or an orchestrator; nothing in the start itself says
  that happens again, and such a kill is never halted however often it repeats. systemd's
  OOM-kill message (MESSAGE_ID fe6faa94...) says more: the unit's memory ran out. After
  serving that is the load's doing (transient); before the server ever served it is the
  model's load meeting the same limit, memory short while loading as "out of memory" is, but
  only by the ending: it leans fatal, so the same kill after about the same time on the next
  start halts.
- *drift*: a change in the served environment since the last good start.
- *repetition* is the policy's (supervisor.decide.policy): the same fingerprint ending
  consecutive starts, each after about the same time.

Each clue has a strength (weak, strong, decisive); the reading whose strongest clue is
stronger wins, equal strengths on both sides are a conflict. `assess` infers fatal on a strong
deterministic win before the server ever served, transient on a strong indeterminate win in
any phase, and otherwise leaves the crash unknown, saying which way the weak evidence leans
(`Verdict.leaning`: the policy halts an unknown crash that leans fatal on its second identical
start instead of its third). A root-cause line the classifier is not sure of (a warning, a
wrapper, a guess) never makes a crash fatal or transient, only leans, with one exception:
a warning or unlevelled line chosen because nothing louder was printed, whose own words
strongly read deterministic, before serving and before an exit of its own (no kill), is the
program saying what is wrong right before it stopped (`_quiet_cause_settles`).
A signature's severity stands (the table may name another one for a phase:
`startup_severity`, `serving_severity`), except a family's catch-all's (a negative
priority: "a CUDA error" of no more specific kind, transient by default): before serving,
strong evidence in its own line settles it instead.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..model import NO_FACTS, Basis, CauseFacts, Confidence, Invocation, Severity, Verdict
from ..model import Phase as Phase  # the phase is the model's (one rule of "served")
from ..model import phase_of as phase_of
from .lexicon import Clue, Lexicon, Reads, Strength, default_lexicon, strongest

if TYPE_CHECKING:
    from .classifier import Classifier

_MAX_CAUSE_CHARS = 4096  # the classifier's own cap on a root-cause line
_CLASS = re.compile(r"(?:^|[\s(])((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt))\b")
_USAGE = re.compile(
    r"\berror: (?:argument |unrecognized arguments|the following (?:required )?arguments|"
    r"invalid (?:choice|value)|unexpected argument)"
)


def judge(
    classifier: Classifier, invocation: Invocation, good_start_s: float, drift: Sequence[str] = ()
) -> tuple[Verdict, Phase]:
    """The whole judgement of an ended invocation from its lines: the classifier's reading,
    the phase, then `verdict_of` (the pipeline runs the same steps, the evidence between)."""
    reading, facts = classifier.examine(invocation)
    phase = phase_of(invocation, good_start_s, reading.phase_hint)
    return verdict_of(classifier, reading, facts, invocation, phase, drift), phase


def verdict_of(
    classifier: Classifier,
    reading: Verdict,
    facts: CauseFacts,
    invocation: Invocation,
    phase: Phase,
    drift: Sequence[str] = (),
) -> Verdict:
    """The verdict of a reading of the lines (`Classifier.examine`): the signature's severity
    for the phase, then `assess`."""
    # A start not read counts as served for a signature's phase severity: a startup-only
    # "fatal" is for a crash known to be one of startup.
    verdict = classifier.for_the_phase(reading, served=phase.served or not phase.start_seen)
    signature = classifier.table.get(verdict.signature) if verdict.signature else None
    catch_all = signature is not None and signature.kind == "cause" and signature.priority < 0
    return assess(
        verdict,
        invocation,
        phase,
        drift,
        facts=facts,
        lexicon=classifier.lexicon,
        catch_all=catch_all,
    )


@dataclass(frozen=True, slots=True)
class Evidence:
    """The clues of one crash and where they point."""

    clues: tuple[Clue, ...]
    reads: Reads | None  # the winning reading; None: no clue, or a conflict
    strength: Strength | None  # the winning reading's strongest clue
    conflict: bool  # equally strong clues point both ways

    def describe(self) -> str:
        """The clues, for a person to check: `words 'is not supported' (not_supported), ...`."""
        return ", ".join(c.describe() for c in self.clues) or "no clue"

    @property
    def leaning(self) -> Severity | None:
        """The severity the evidence points to, however weak."""
        if self.reads is Reads.DETERMINISTIC:
            return Severity.FATAL
        if self.reads is Reads.INDETERMINATE:
            return Severity.TRANSIENT
        return None

    def settles(self) -> bool:
        """Strong enough to settle a severity without a signature."""
        return self.strength is not None and self.strength >= Strength.STRONG


def weigh(
    verdict: Verdict,
    facts: CauseFacts = NO_FACTS,
    lexicon: Lexicon | None = None,
    invocation: Invocation | None = None,
    phase: Phase | None = None,
) -> Evidence:
    """The clues of the root cause's words, class and raise site, and of how the invocation
    ended, weighed against each other. A line that only points at a cause printed elsewhere
    says nothing by its words, nor does a guess (the last line that looked like trouble): then
    only the traceback's frame and the ending count."""
    lexicon = lexicon or default_lexicon()
    cause = (verdict.root_cause or "")[:_MAX_CAUSE_CHARS]
    clues: list[Clue] = []
    if invocation is not None and (ended := _killed(invocation, phase, facts)) is not None:
        clues.append(ended)
    if not (facts.pointer or facts.guessed):
        words = (facts.words or cause)[:_MAX_CAUSE_CHARS]
        clues.extend(lexicon.words(words))
        if (numbers := lexicon.capacity(words)) is not None:
            clues.append(numbers)
        exception = facts.exception if facts is not NO_FACTS else _exception_kind(cause)
        if (by_class := lexicon.exception(exception)) is not None:
            clues.append(by_class)
    if (site := lexicon.site(facts.frame, facts.callers)) is not None:
        clues.append(site)
    deterministic = strongest(clues, Reads.DETERMINISTIC)
    indeterminate = strongest(clues, Reads.INDETERMINATE)
    if deterministic == indeterminate:  # both None, or a conflict
        return Evidence(tuple(clues), None, deterministic, conflict=deterministic is not None)
    if (deterministic or 0) > (indeterminate or 0):
        return Evidence(tuple(clues), Reads.DETERMINISTIC, deterministic, conflict=False)
    return Evidence(tuple(clues), Reads.INDETERMINATE, indeterminate, conflict=False)


# The main process killed by SIGKILL or SIGTERM with no stop job (that is Ending.STOPPED): the
# OOM killer, a person, an orchestrator. A crash inside dumps core or exits with a status.
_OUTSIDE_SIGNALS = {9: "SIGKILL", 15: "SIGTERM"}
# Results for which systemd itself sent the signal (TimeoutStartSec=, WatchdogSec=): the same
# start may take as long again, so the kill says nothing of a restart.
_SYSTEMD_OWN_KILLS = frozenset({"timeout", "watchdog"})


def _killed(invocation: Invocation, phase: Phase | None, facts: CauseFacts) -> Clue | None:
    """How systemd says the invocation ended, when that was a kill: the OOM killer before the
    server ever served (the load's memory peak, met again: leans deterministic), or any other
    kill from outside (the OOM killer after serving, a person's or an orchestrator's signal).
    An engine that said it kills its own process tree ended itself (`facts.killed_itself`)."""
    if facts.killed_itself and not invocation.oom_killed:
        return None
    if invocation.oom_killed and phase is not None and not phase.served and phase.start_seen:
        said = "killed by the OOM killer before the server ever served"
        return Clue("oom_kill_while_loading", Reads.DETERMINISTIC, Strength.WEAK, said, "ended")
    if invocation.oom_killed:
        said = "killed by the OOM killer"
    elif invocation.result in _SYSTEMD_OWN_KILLS:
        return None  # systemd's own kill of a start that took too long: not from outside
    elif invocation.exit_code == "killed" and invocation.exit_status in _OUTSIDE_SIGNALS:
        said = f"killed by {_OUTSIDE_SIGNALS[invocation.exit_status]}"
    else:
        return None
    return Clue("killed_from_outside", Reads.INDETERMINATE, Strength.STRONG, said, "ended")


def assess(
    verdict: Verdict,
    invocation: Invocation,
    phase: Phase,
    drift: Sequence[str] = (),
    *,
    facts: CauseFacts = NO_FACTS,
    lexicon: Lexicon | None = None,
    catch_all: bool = False,
) -> Verdict:
    """The verdict with a severity for a crash no signature settled, its basis and reason.

    `catch_all`: the verdict's signature is a family's fallback (a negative priority: "a CUDA
    error" of no more specific kind). Its severity is the table's default for words it cannot
    tell apart; before the server ever served, strong evidence of the other severity in the
    line's own words settles it instead."""
    changed = f"; changed since the last good start: {'; '.join(drift)}" if drift else ""
    if catch_all and (overruled := _overruled(verdict, invocation, phase, facts, lexicon)):
        return overruled
    if verdict.severity is not Severity.UNKNOWN:
        basis = Basis.SIGNATURE if verdict.signature else Basis.INFERRED
        reason = f"{verdict.severity.value} ({basis.value} {verdict.signature or ''}".rstrip()
        return dataclasses.replace(
            verdict,
            basis=basis,
            confidence=verdict.confidence or Confidence.HIGH,
            severity_reason=f"{reason}): {verdict.title}, {phase.describe()}{changed}",
        )
    if not (invocation.failed or verdict.crashed) or verdict.from_context:
        return verdict
    if verdict.basis is Basis.SIGNATURE:
        return verdict  # the table's word for this phase: unknown (classify.for_the_phase)
    cause = (verdict.root_cause or "")[:_MAX_CAUSE_CHARS]
    kind = _exception_kind(cause) or (facts.exception if facts.raise_statement else None)
    evidence = weigh(verdict, facts, lexicon, invocation, phase)
    clues = f"; evidence: {evidence.describe()}"
    if not phase.served and not phase.start_seen:
        return _unknown(
            verdict,
            f"unknown: {kind or 'a crash'} of a run whose start was not in the journal read "
            f"(how long it ran, and whether it served, are not known){clues}",
        )
    if verdict.confidence is Confidence.LOW:
        if (killed := _killed_settles(evidence)) is not None:
            return _inferred(
                verdict,
                Severity.TRANSIENT,
                f"transient (inferred): {killed} {phase.describe()}, no stop job, and nothing "
                f"in its own lines says why: systemd's record is the cause, and a restart does "
                f"not meet someone else's signal again{clues}",
            )
        if not (lexicon or default_lexicon()).coped(cause) and (
            said := _quiet_cause_settles(verdict, facts, evidence, phase, invocation)
        ):
            return _inferred(
                verdict,
                Severity.FATAL,
                f"fatal (inferred): {said} {phase.describe()}, and nothing louder explains "
                f"the exit: the same start prints it again{clues}{changed}",
            )
        if _loading_site(verdict, evidence, phase):
            return _loading_site_verdict(verdict, kind, phase, clues + changed)
        return _unknown(
            verdict,
            f"unknown: no error line names the cause ({kind or 'a guess'}) "
            f"{phase.describe()}{_leans(evidence)}{clues}",
            evidence.leaning,
        )
    if evidence.conflict:
        return _unknown(
            verdict,
            f"unknown: {kind or 'an error'} {phase.describe()} whose evidence reads both as "
            f"deterministic and as a network, timeout or busy error{_repeats(phase)}{clues}",
        )
    if evidence.reads is Reads.INDETERMINATE and evidence.settles():
        return _inferred(
            verdict,
            Severity.TRANSIENT,
            f"transient (inferred): {kind or 'a network, timeout or busy error'} "
            f"{phase.describe()}: a restart may not meet it again{clues}",
        )
    if phase.served:
        return _unknown(
            verdict,
            f"unknown: {kind or 'a crash'} {phase.describe()}: a restart may work, and repeats "
            f"after serving are no proof{clues}",
        )
    if evidence.reads is Reads.DETERMINISTIC and evidence.settles():
        return _inferred(
            verdict,
            Severity.FATAL,
            f"fatal (inferred): {kind or 'a deterministic error'} {phase.describe()}: the "
            f"same inputs raise it again{clues}{changed}",
        )
    if _loading_site(verdict, evidence, phase):
        return _loading_site_verdict(verdict, kind, phase, clues + changed)
    if drift and evidence.reads is not Reads.INDETERMINATE:
        return _inferred(
            verdict,
            Severity.FATAL,
            f"fatal (inferred): a crash {phase.describe()}, right after the environment "
            f"changed{changed}{clues}",
        )
    return _unknown(
        verdict,
        f"unknown: {kind or 'no known error'} {phase.describe()}{_leans(evidence)}{clues}",
        evidence.leaning,
    )


def _overruled(
    verdict: Verdict,
    invocation: Invocation,
    phase: Phase,
    facts: CauseFacts,
    lexicon: Lexicon | None,
) -> Verdict | None:
    """A catch-all signature's severity, when its line's evidence strongly says the other."""
    if phase.served or not phase.start_seen or verdict.confidence is Confidence.LOW:
        return None
    if verdict.severity not in (Severity.FATAL, Severity.TRANSIENT):
        return None
    evidence = weigh(verdict, facts, lexicon, invocation, phase)
    severity = evidence.leaning
    if not evidence.settles() or severity is None or severity is verdict.severity:
        return None
    kind = _exception_kind((verdict.root_cause or "")[:_MAX_CAUSE_CHARS]) or "an error"
    return _inferred(
        verdict,
        severity,
        f"{severity.value} (inferred): {kind} {phase.describe()}; the table's catch-all "
        f"'{verdict.signature}' says {verdict.severity.value} for any such error, its own "
        f"words say more; evidence: {evidence.describe()}",
    )


_STARTUP_WORDS = "its traceback runs through the start-up steps"


def _killed_settles(evidence: Evidence) -> str | None:
    """A start with no cause line whose main process systemd saw killed from outside (a
    signal with no stop job, or the OOM killer after serving), with no clue the other way:
    the kill is the cause the journal knows for sure. What systemd said; None otherwise."""
    if evidence.conflict or evidence.reads is not Reads.INDETERMINATE:
        return None
    ended = [c for c in evidence.clues if c.kind == "ended" and c.reads is Reads.INDETERMINATE]
    return ended[0].said if ended else None


def _quiet_cause_settles(
    verdict: Verdict,
    facts: CauseFacts,
    evidence: Evidence,
    phase: Phase,
    invocation: Invocation,
) -> str | None:
    """A warning or an unlevelled line chosen as the cause because nothing louder was printed
    (not a wrapper, nor a guess but the last warning of a start that printed no error line),
    whose own words strongly read deterministic, in a start
    that never served and ended with an exit status of its own (no kill from outside): the
    program said what is wrong and stopped. What it was, for the reason; None otherwise.

    An engineer reads `flashinfer-cubin version (0.6.13) does not match ...` printed right
    before a bare exit as the cause; a line after serving, or one whose run was killed, or
    one with any word the other way, or one saying the program coped and went on (`Ignore
    import error ...`, read by `assess`), proves nothing."""
    if facts.guessed or facts.pointer or phase.served or not phase.start_seen:
        return None
    if invocation.oom_killed or (invocation.exit_code == "killed" and not facts.killed_itself):
        return None
    if evidence.conflict or any(c.reads is Reads.INDETERMINATE for c in evidence.clues):
        return None
    words = [c for c in evidence.clues if c.kind == "words" and c.reads is Reads.DETERMINISTIC]
    if not any(c.strength >= Strength.STRONG for c in words):
        return None
    return f"a warning or unlevelled line whose words read deterministic ({words[0].said!r})"


def _loading_site(verdict: Verdict, evidence: Evidence, phase: Phase) -> bool:
    """Two weak clues that agree make a strong one: the innermost frame is in deterministic
    code (model and weight loading, kernel selection, configuration, a `_check_*` function)
    and the traceback runs through the start-up steps (load_model, init_device, warmup...),
    before the server ever served, with no clue at all the other way. A crash raised there
    meets the same files, GPU and arguments on the next start; a network, timeout or kill
    always leaves a clue of its own (its words, its class, its module, its ending)."""
    if phase.served or not phase.start_seen or verdict.phase_hint == "serving":
        return False
    if evidence.conflict or any(c.reads is Reads.INDETERMINATE for c in evidence.clues):
        return False
    return any(c.kind == "raised in" and c.reads is Reads.DETERMINISTIC for c in evidence.clues)


def _loading_site_verdict(verdict: Verdict, kind: str | None, phase: Phase, said: str) -> Verdict:
    return _inferred(
        verdict,
        Severity.FATAL,
        f"fatal (inferred): {kind or 'a crash'} raised in deterministic code while the server "
        f"was starting ({_STARTUP_WORDS}), {phase.describe()}: where and when agree, and no "
        f"clue says a restart could help{said}",
    )


def _leans(evidence: Evidence) -> str:
    """How the policy treats an unknown crash, by the way its evidence leans."""
    if evidence.leaning is Severity.FATAL:
        return (
            "; the evidence leans deterministic but is too weak to settle it: halted when the "
            "same crash ends the next start after about the same time"
        )
    return "; halted only when the same crash repeats"


def _repeats(phase: Phase) -> str:
    return "; halted only when it repeats" if not phase.served else ""


def _inferred(verdict: Verdict, severity: Severity, reason: str) -> Verdict:
    return dataclasses.replace(
        verdict,
        severity=severity,
        basis=Basis.INFERRED,
        confidence=Confidence.MEDIUM,
        severity_reason=reason,
    )


def _unknown(verdict: Verdict, reason: str, leaning: Severity | None = None) -> Verdict:
    return dataclasses.replace(
        verdict,
        basis=Basis.UNKNOWN,
        confidence=verdict.confidence or Confidence.LOW,
        severity_reason=reason,
        leaning=leaning,
    )


def _exception_kind(text: str) -> str | None:
    """The exception class named by a root-cause line, or its crash form."""
    if "(Rust panic in thread " in text:
        return "a Rust panic"
    if _USAGE.search(text):
        return "a command-line usage error"
    match = _CLASS.search(text)
    if match is None:
        return None
    return match.group(1).rsplit(".", 1)[-1]
