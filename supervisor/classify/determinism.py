"""Will the next start crash the same way? Evidence beside the signatures.

The signature table will never list every message. What generalises is what the daemon already
knows about an ended invocation:

- *phase*: did it ever serve (a serving line, requests handled, or it ran `good_start_s`)? A
  crash during startup repeats with the same config and packages; one after hours of serving is
  more likely load- or request-triggered.
- *the exception*: classes that do not change between attempts with the same inputs (an import
  error, an undefined symbol, AttributeError, TypeError, KeyError, a shape error, AssertionError,
  NotImplementedError, ValueError and pydantic's validation errors, a usage error, a missing
  model path, a Rust panic in `main`, a linker or compiler error), before the server ever
  served, versus those that can change (connection errors, timeouts). Both kinds in one line,
  a guessed line (no error line at all), or a run whose start was not read: no inference.
- *drift*: a change in the served environment since the last good start.
- *repetition* is the policy's (supervisor.decide.policy): the same fingerprint ending consecutive
  invocations, each within the same short time of starting.

`assess` turns a verdict whose severity no signature settled into an inferred one, and says
why in one line a person can check ("fatal (inferred): KeyError before the server ever served:
the same inputs raise it again"). A signature's severity stands (the table may name another
one for a phase: `startup_severity`, `serving_severity`); an unknown crash after serving
stays unknown.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..model import Invocation, Severity, Verdict

if TYPE_CHECKING:
    from .classifier import Classifier

_MAX_CAUSE_CHARS = 4096  # the classifier's own cap on a root-cause line
# argparse's and clap's (TGI's launcher) usage errors.
_USAGE_ERROR = (
    r"\berror: (?:argument |unrecognized arguments|the following (?:required )?arguments|"
    r"invalid (?:choice|value)|unexpected argument)"
)
_USAGE = re.compile(_USAGE_ERROR)
# Exceptions and crash forms that a restart with the same inputs raises again.
_DETERMINISTIC = re.compile(
    r"\b(?:ModuleNotFoundError|ImportError|PackageNotFoundError|AttributeError|TypeError|"
    r"KeyError|IndexError|NameError|SyntaxError|AssertionError|NotImplementedError|"
    r"ValueError|ValidationError|JSONDecodeError|TOMLDecodeError|FileNotFoundError|"
    r"IsADirectoryError|NotADirectoryError|HFValidationError|RepositoryNotFoundError|"
    r"RevisionNotFoundError|EntryNotFoundError|GatedRepoError|OfflineModeIsEnabled|"
    r"LocalEntryNotFoundError|SafetensorError|UnpicklingError|UnicodeDecodeError|"
    r"OverflowError|ZeroDivisionError|RecursionError|UnboundLocalError|PermissionError)\b"
    r"|undefined symbol|[Ss]ymbol not found|cannot open shared object file|"
    rf"{_USAGE_ERROR}|\(Rust panic in thread 'main'|\bld(?:\.\w+)?: cannot find|collect2: error|"
    r": fatal error: |nvcc fatal|ninja: build stopped|Error building extension|"
    r"does not exist|is not supported|not compiled with|size mismatch for|"
    r"Error\(s\) in loading state_dict|Failed to infer device type|No CUDA GPUs are available"
)
# Errors a restart may not meet again: the network, a peer, a timeout, memory under load.
_INDETERMINATE = re.compile(
    r"\b(?:ConnectionError|ConnectionRefusedError|ConnectionResetError|ConnectionAbortedError|"
    r"TimeoutError|ReadTimeout|ConnectTimeout|ReadTimeoutError|ConnectTimeoutError|"
    r"ProtocolError|RemoteDisconnected|DistNetworkError|DistStoreError|BrokenPipeError|"
    r"HfHubHTTPError|ChunkedEncodingError|ConnectError)\b"
    r"|[Tt]imed? ?out|[Tt]emporary failure in name resolution|Name or service not known|"
    r"Connection (?:refused|reset|closed)|Network is unreachable|[Ww]atchdog|"
    r"(?:[Cc]ouldn't|[Cc]ould not|[Ff]ailed to|[Uu]nable to) connect to|"
    r"[Cc]heck your (?:internet )?connection|Internet connection is|"
    r"\b50[234]\b[^\n]{0,80}?(?:Server Error|Gateway|Unavailable)"
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Phase:
    """How far the invocation got before it ended."""

    served: bool
    ran_s: float | None = None  # from its first entry to its end
    serving_s: float | None = None  # from its first serving line to its end, when known
    start_seen: bool = True  # False: read from the journal's middle, its start unknown

    def describe(self) -> str:
        """In words: before the server ever served, or after serving for how long."""
        if not self.served:
            return "before the server ever served"
        if self.serving_s is not None:
            return f"after serving for {_duration(self.serving_s)}"
        return "after serving"


def phase_of(invocation: Invocation, good_start_s: float, hint: str | None = None) -> Phase:
    """Served: it logged that it serves (requests included), it ran at least `good_start_s`,
    or, with nothing in the journal either way, the crash's frames are request handling."""
    ran = invocation.ran_s
    serving_s = None
    if invocation.served_us is not None and invocation.ended_us is not None:
        serving_s = max(0.0, (invocation.ended_us - invocation.served_us) / 1e6)
    served = invocation.served or (ran is not None and ran >= good_start_s)
    if not served and hint == "serving":
        served = True
    return Phase(served=served, ran_s=ran, serving_s=serving_s, start_seen=invocation.start_seen)


def judge(
    classifier: Classifier, invocation: Invocation, good_start_s: float, drift: Sequence[str] = ()
) -> tuple[Verdict, Phase]:
    """The whole judgement of an ended invocation, as the pipeline makes it: the classifier's
    verdict, the phase, the signature's severity for that phase, then `assess`."""
    verdict = classifier.classify_invocation(invocation)
    phase = phase_of(invocation, good_start_s, verdict.phase_hint)
    # A start not read counts as served for a signature's phase severity: a startup-only
    # "fatal" is for a crash known to be one of startup.
    verdict = classifier.for_the_phase(verdict, served=phase.served or not phase.start_seen)
    return assess(verdict, invocation, phase, drift), phase


def assess(
    verdict: Verdict, invocation: Invocation, phase: Phase, drift: Sequence[str] = ()
) -> Verdict:
    """The verdict with a severity for a crash no signature settled, its basis and reason."""
    changed = f"; changed since the last good start: {'; '.join(drift)}" if drift else ""
    if verdict.severity is not Severity.UNKNOWN:
        basis = "signature" if verdict.signature else "inferred"
        reason = f"{verdict.severity.value} ({basis} {verdict.signature or ''}".rstrip()
        return dataclasses.replace(
            verdict,
            basis=basis,
            confidence=verdict.confidence or "high",
            severity_reason=f"{reason}): {verdict.title}, {phase.describe()}{changed}",
        )
    if not (invocation.failed or verdict.crashed) or verdict.from_context:
        return verdict
    if verdict.basis == "signature":
        return verdict  # the table's word for this phase: unknown (classify.for_the_phase)
    cause = (verdict.root_cause or "")[:_MAX_CAUSE_CHARS]
    kind = _exception_kind(cause)
    if not phase.served and not phase.start_seen:
        return _unknown(
            verdict,
            f"unknown: {kind or 'a crash'} of a run whose start was not in the journal read "
            "(how long it ran, and whether it served, are not known)",
        )
    if verdict.confidence == "low":
        return _unknown(
            verdict,
            f"unknown: no error line names the cause ({kind or 'a guess'}) "
            f"{phase.describe()}; halted only when the same crash repeats",
        )
    if phase.served:
        return _unknown(
            verdict,
            f"unknown: {kind or 'a crash'} {phase.describe()}: a restart may work, and repeats "
            "after serving are no proof",
        )
    deterministic, indeterminate = _DETERMINISTIC.search(cause), _INDETERMINATE.search(cause)
    if deterministic and indeterminate:
        return _unknown(
            verdict,
            f"unknown: {kind or 'an error'} {phase.describe()} that reads as both a "
            "deterministic error and a network or timeout one; halted only when it repeats",
        )
    if indeterminate:
        return _inferred(
            verdict,
            Severity.TRANSIENT,
            f"transient (inferred): {kind or 'a network or timeout error'} "
            f"{phase.describe()}: a restart may not meet it again",
        )
    if deterministic:
        return _inferred(
            verdict,
            Severity.FATAL,
            f"fatal (inferred): {kind or 'a deterministic error'} {phase.describe()}: the "
            f"same inputs raise it again{changed}",
        )
    if drift:
        return _inferred(
            verdict,
            Severity.FATAL,
            f"fatal (inferred): a crash {phase.describe()}, right after the environment "
            f"changed{changed}",
        )
    return _unknown(
        verdict,
        f"unknown: {kind or 'no known error'} {phase.describe()}; halted only when the same "
        "crash repeats",
    )


def _inferred(verdict: Verdict, severity: Severity, reason: str) -> Verdict:
    return dataclasses.replace(
        verdict, severity=severity, basis="inferred", confidence="medium", severity_reason=reason
    )


def _unknown(verdict: Verdict, reason: str) -> Verdict:
    return dataclasses.replace(
        verdict, basis="unknown", confidence=verdict.confidence or "low", severity_reason=reason
    )


_CLASS = re.compile(r"(?:^|[\s(])((?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt))\b")


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


def _duration(seconds: float) -> str:
    minutes = int(seconds // 60)
    if minutes < 1:
        return f"{seconds:.0f} s"
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60} min"
