"""Will the next start crash the same way? Evidence beside the signatures.

The signature table will never list every message. What generalises is what the daemon already
knows about an ended invocation:

- *phase*: did it ever serve (a serving line, requests handled, or it ran `good_start_s`)? A
  crash during startup repeats with the same config and packages; one after hours of serving is
  more likely load- or request-triggered.
- *the exception*: classes that do not change between attempts with the same inputs (an import
  error, an undefined symbol, AttributeError, TypeError, KeyError or a shape error while loading
  weights, AssertionError, NotImplementedError, ValueError and pydantic's validation errors, an
  argparse usage error, a missing model path, a Rust panic before serving, a linker or compiler
  error) versus those that can change (connection errors, timeouts, NCCL timeouts, an OOM under
  load).
- *drift*: a change in the served environment since the last good start.
- *repetition* is the policy's (supervisor.policy): the same fingerprint ending consecutive
  invocations, each within the same short time of starting.

`assess` turns a verdict whose severity no signature settled into an inferred one, and says
why in one line a person can check ("fatal (inferred): KeyError while loading weights, before the
server ever served"). A signature's severity stands (the table may name another one for a phase:
`startup_severity`, `serving_severity`); an unknown crash after serving stays unknown.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from supervisor.model import Invocation, Severity, Verdict

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
    r"\b50[234]\b.*(?:Server Error|Gateway|Unavailable)"
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Phase:
    """How far the invocation got before it ended."""

    served: bool
    ran_s: float | None = None  # from its first entry to its end
    serving_s: float | None = None  # from its first serving line to its end, when known

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
    return Phase(served=served, ran_s=ran, serving_s=serving_s)


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
        return verdict  # the table's word for this phase: unknown (classify._for_the_phase)
    cause = verdict.root_cause or ""
    kind = _exception_kind(cause)
    if phase.served:
        return dataclasses.replace(
            verdict,
            basis="unknown",
            confidence=verdict.confidence or "low",
            severity_reason=f"unknown: {kind or 'a crash'} {phase.describe()}: a restart may "
            "work, and repeats after serving are no proof",
        )
    if _INDETERMINATE.search(cause) and not _DETERMINISTIC.search(cause):
        return dataclasses.replace(
            verdict,
            severity=Severity.TRANSIENT,
            basis="inferred",
            confidence="medium",
            severity_reason=f"transient (inferred): {kind or 'a network or timeout error'} "
            f"{phase.describe()}: a restart may not meet it again",
        )
    if _DETERMINISTIC.search(cause):
        return dataclasses.replace(
            verdict,
            severity=Severity.FATAL,
            basis="inferred",
            confidence="medium",
            severity_reason=f"fatal (inferred): {kind or 'a deterministic error'} "
            f"{phase.describe()}: the same inputs raise it again{changed}",
        )
    if drift:
        return dataclasses.replace(
            verdict,
            severity=Severity.FATAL,
            basis="inferred",
            confidence="medium",
            severity_reason=f"fatal (inferred): a crash {phase.describe()}, right after the "
            f"environment changed{changed}",
        )
    return dataclasses.replace(
        verdict,
        basis="unknown",
        confidence=verdict.confidence or "low",
        severity_reason=f"unknown: {kind or 'no known error'} {phase.describe()}; halted only "
        "when the same crash repeats",
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
