"""Find the root cause of an invocation's crash and classify it against the signature table.

Pure: lines in, `Verdict` out; no IO, no logging. The steps:

1. `logline.annotate` strips prefixes, de-interleaves processes and reassembles tracebacks.
2. Every line that can carry a cause (not a frame or code line) is matched against the table.
3. Candidates are ranked by tier: a line matching a cause signature; an exception line no
   signature knows (or, in a traceback cut before its exception line, the innermost frame's
   `raise X(...)` statement); an error-level message no signature knows; a quieter line whose
   words the lexicon reads as a cause (a warning that carries an exception, an unlevelled line
   printed before the server took requests); a generic wrapper (`Engine core initialization
   failed`, `Worker died`) last, because a wrapper only points at a cause printed elsewhere.
   What no signature lists is known for a wrapper by its form (the message that introduced a
   traceback, a line ending in `:`) and its words (the lexicon's pointers, `See root cause
   above`). An error the program says it coped with (`retrying`, `falling back`) ranks with
   the quieter lines. Noise lines and `Exception ignored in` tracebacks are never candidates,
   nor is a line a client could have written (see `clients_from`). Within a tier the higher
   signature priority wins (a specific diagnosis over a generic consequence), then the earliest
   line: Python prints the cause of a chained traceback first, and across processes the first
   failure is the cause of the others.

An exception with no message (`AssertionError`, `TimeoutError`) says nothing by itself; its
failing source line (`assert param_data.shape == ...`) becomes the root-cause text, and
signatures may require a traceback frame (`frames = [...]`) to tell such cases apart.

`classify_invocation` adds what the journal knows of the invocation. The root cause belongs to
the crash: an error logged while the server served, more than `cause_window_s` before the end
(one bad request hours earlier), is context and ranks below every other candidate; chosen only
when nothing else explains the end, and then never as fatal. An end that systemd explains
(an OOM kill, a signal) beats such context. How an invocation ended without a crash (a skipped
start, a stop while its gate ran, the host's reboot) is said as such, and lines lost to the
memory caps or journald's rate limit are counted in the notes.
"""

from __future__ import annotations

import dataclasses
import re
import signal
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from ..engines.profiles import Engines, follow
from ..environment.serving import is_serving_line
from ..model import (
    EMPTY,
    ENDINGS,
    NO_FACTS,
    Basis,
    CauseFacts,
    Confidence,
    Ending,
    Invocation,
    LogLine,
    Severity,
    Verdict,
)
from .fingerprint import fingerprint
from .lexicon import CAUSE_READINGS, Lexicon, Reads, default_lexicon
from .logline import (
    INFO_LEVELS,
    Annotated,
    ParsedLine,
    Role,
    TracebackBlock,
    annotate,
    carried_cause,
    crash_form,
    exception_name,
    parse_line,
    raise_statement,
    raise_without_message,
)
from .signatures import SignatureMatch, SignatureTable

# A line matching a cause signature; an exception (or another crash form: a Rust panic, a usage
# error, C++'s `what():`) no signature knows; an error-level message; a cause signature matched
# on a warning-level line (a warning printed at import is context unless nothing else
# explains the crash); a generic wrapper; an error logged long before the end while serving.
_TIER_CAUSE, _TIER_EXCEPTION, _TIER_ERROR, _TIER_WARNING, _TIER_WRAPPER, _TIER_CONTEXT = (
    5, 4, 3, 2, 1, 0,
)  # fmt: skip
DEFAULT_CAUSE_WINDOW_S = 120.0
_CONFIDENCE = {
    _TIER_CAUSE: Confidence.HIGH,
    _TIER_EXCEPTION: Confidence.MEDIUM,
    _TIER_ERROR: Confidence.MEDIUM,
    _TIER_WARNING: Confidence.LOW,
    _TIER_WRAPPER: Confidence.LOW,
    _TIER_CONTEXT: Confidence.LOW,
}
_MATCHED_ROLES = frozenset({Role.MESSAGE, Role.HEADER, Role.EXCEPTION, Role.DETAIL})
_ERROR_LEVELS = frozenset({"ERROR", "CRITICAL"})
# A cause signature on a line logged below error level (a warning at import, an INFO line on
# the KV cache) explains the crash only when no error or exception does.
_QUIET_LEVELS = frozenset({"DEBUG", "INFO", "WARNING"})
# A request log line (vLLM's RequestLogger, SGLang's request dump: each engine file's
# request_lines) quotes what a client sent.
_REQUEST_LOG: re.Pattern[str]
# Frames of a request being handled: the ASGI server's protocol and the web framework.
_REQUEST_FRAMES = ("/uvicorn/protocols/", "/starlette/", "/fastapi/", "/aiohttp/web_protocol.py")
_CODE_LIKE = re.compile(r"\s+(?:raise |return |assert |await |yield |self\.|\w+ = )")
# The crash site is the frame a reader acts on: the model code that was running (a model's
# layer, e.g. deepseek_v2.py building its attention), else the deepest frame of the server's own
# code (where it called into the failing library: flashinfer, torch), else the last frame. The
# paths are the engine files' model_paths and server_paths.
_SERVER_PATHS: tuple[str, ...]
_MODEL_PATHS: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Candidate:
    """A line that may be the root cause."""

    tier: int
    priority: int
    index: int
    text: str
    match: SignatureMatch | None

    def key(self) -> tuple[int, int, int]:
        """Sort key, best first."""
        return (-self.tier, -self.priority, self.index)


@dataclass(frozen=True, slots=True)
class _RequestErrors:
    """Requests' own errors in an invocation's lines: never a cause, a guess or a crash."""

    blocks: frozenset[int] = frozenset()  # traceback block ids
    lines: frozenset[int] = frozenset()  # their lines, and what introduced them
    first: str | None = None  # the first one's exception line, for the note


_NO_REQUEST_ERRORS = _RequestErrors()
REQUESTS_NOTE = "requests do not end the server"


def _chained_into(ann: Annotated, index: int, blocks: set[int]) -> bool:
    """Some block of `blocks` was raised while handling block `index`."""
    return any(ann.blocks[b].chained_from == index for b in blocks)


def _told_requests(verdict: Verdict, requests: _RequestErrors) -> Verdict:
    """With no cause of its own, say that a request's error was logged and is none."""
    if requests.first is None:
        return verdict
    note = (
        f"a request's error was logged ({requests.first[:200]}): it ended that request; "
        f"{REQUESTS_NOTE}, so it is not this crash's cause"
    )
    return dataclasses.replace(verdict, notes=(*verdict.notes, note))


class Classifier:
    """Turns an invocation's lines into a Verdict using one signature table."""

    def __init__(
        self,
        table: SignatureTable,
        *,
        max_line_chars: int = 4096,
        cause_window_s: float = DEFAULT_CAUSE_WINDOW_S,
        lexicon: Lexicon | None = None,
    ) -> None:
        self.table = table
        self.max_line_chars = max_line_chars
        self.cause_window_us = int(cause_window_s * 1_000_000)
        self.lexicon = lexicon or default_lexicon()

    def classify(
        self, lines: Sequence[LogLine], *, context_before_us: int | None = None
    ) -> Verdict:
        """The verdict for one invocation's lines (journal lines or plain text, pid=None).

        Lines logged before `context_before_us` (journal time) are context, not causes.
        """
        return self._classify(lines, context_before_us)[0]

    def _classify(
        self, lines: Sequence[LogLine], context_before_us: int | None
    ) -> tuple[Verdict, CauseFacts, _RequestErrors]:
        ann = annotate(lines)
        opened = clients_from(ann.lines)
        requests = self._requests_own(ann)
        candidates = [
            c
            for i in range(len(ann.lines))
            if i not in requests.lines and (c := self._candidate(ann, i, opened))
        ]
        candidates += [c for c in self._raise_statements(ann) if c.index not in requests.lines]
        crashed_blocks = [
            b for i, b in enumerate(ann.blocks) if not b.ignored and i not in requests.blocks
        ]
        if not candidates:
            verdict = _no_cause(ann, crashed_blocks)
            return _told_requests(verdict, requests), _site_only(ann, crashed_blocks), requests
        if context_before_us is not None:
            candidates = [_as_context(c, lines[c.index], context_before_us) for c in candidates]
        best = min(candidates, key=_Candidate.key)
        best = _reraised_in_the_same_words(ann, _raised_instead(ann, best, candidates), candidates)
        best = self._explained_by_its_reraise(ann, best, candidates)
        return self._verdict(ann, best, crashed_blocks), self._facts(ann, best), requests

    def _explained_by_its_reraise(
        self, ann: Annotated, best: _Candidate, candidates: list[_Candidate]
    ) -> _Candidate:
        """An exception whose words say nothing of why (`JSONDecodeError: Unterminated string
        starting at: line 17 column 3`), re-raised as one whose words do (transformers' `OSError:
        It looks like the config file at '.../config.json' is not a valid JSON file.`): the
        re-raise names the cause an operator acts on. One whose own words read either way stays
        (`Connection reset by peer` before a misleading `Can't load the configuration`)."""
        if self.lexicon.words(ann.lines[best.index].text):
            return best
        later = [
            c
            for c in _reraises_of(ann, best, candidates)
            if self.lexicon.line_kind(ann.lines[c.index].text) in CAUSE_READINGS
        ]
        return min(later, key=_Candidate.key) if later else best

    def _requests_own(self, ann: Annotated) -> _RequestErrors:
        """The tracebacks of requests' own errors (a class the lexicon's [[request]] names,
        raised through a request's handling) with the lines that introduced them."""
        blocks: set[int] = set()
        for index, block in enumerate(ann.blocks):
            if block.exception is None:
                continue
            named = exception_name(ann.lines[block.exception].text)
            if self.lexicon.request_error(named) and _handles_a_request(ann, block):
                blocks.add(index)
        # A traceback raised while handling one of them is the same request's.
        grew = True
        while grew:
            grew = False
            for index, block in enumerate(ann.blocks):
                if index in blocks:
                    continue
                if block.chained_from in blocks or _chained_into(ann, index, blocks):
                    blocks.add(index)
                    grew = True
        lines: set[int] = set()
        first: str | None = None
        for index in sorted(blocks):
            block = ann.blocks[index]
            parts = [block.header, block.intro, block.exception, *block.frames, *block.details]
            lines.update(i for i in parts if i is not None)
            lines.update(block.code.values())
            if first is None and block.exception is not None:
                first = ann.lines[block.exception].text.strip()
        return _RequestErrors(frozenset(blocks), frozenset(lines), first)

    def classify_invocation(self, invocation: Invocation) -> Verdict:
        """The verdict for one ended invocation, with what the journal says of how it ended."""
        return self.examine(invocation)[0]

    def examine(self, invocation: Invocation) -> tuple[Verdict, CauseFacts]:
        """`classify_invocation`'s verdict and what its root cause's traceback says beside it
        (the class, the raise site: determinism.judge weighs them)."""
        ending = invocation.ending
        if not ENDINGS[ending].ran:
            return _not_a_run(ending), NO_FACTS
        context_before = None
        if invocation.served_us is not None and invocation.ended_us is not None:
            context_before = invocation.ended_us - self.cause_window_us
        verdict, facts, requests = self._classify(invocation.lines, context_before)
        if verdict.from_context:
            verdict, facts = _prefer_the_end(verdict, invocation), NO_FACTS
            if not invocation.failed:
                verdict = dataclasses.replace(verdict, crashed=False)
        if ending is Ending.BOOT:
            verdict = dataclasses.replace(
                verdict,
                title="Ended with the boot",
                severity=Severity.UNKNOWN,
                crashed=False,
                notes=(*verdict.notes, "the host rebooted (or lost power) before the unit ended"),
            )
            return verdict, NO_FACTS
        if invocation.failed and verdict.root_cause is None:
            verdict, warned = _failed_without_cause(
                verdict, invocation, self._is_noise, self._reads, skip=requests.lines
            )
            # A warning whose words name a cause, the loudest line of a start that then
            # stopped, is read for its words; any other guess only for its frame and ending.
            facts = dataclasses.replace(facts, guessed=not warned)
        if _killed_itself(invocation):
            facts = dataclasses.replace(facts, killed_itself=True)
        notes = (*verdict.notes, *_loss_notes(invocation, verdict))
        return dataclasses.replace(verdict, notes=notes), facts

    def _is_noise(self, text: str) -> bool:
        match = self.table.match(text)
        return match is not None and match.signature.kind == "noise"

    def _reads(self, text: str) -> bool:
        """The lexicon reads `text`'s words as a cause (not a pointer, not a coped report)."""
        return self.lexicon.line_kind(text) in CAUSE_READINGS

    def for_the_phase(self, verdict: Verdict, *, served: bool) -> Verdict:
        """A signature's severity for the phase it crashed in, when the table names one
        (`served` as determinism.phase_of says it: a serving line, good_start_s, the frames).
        Applied once, after classify_invocation; a severity the classifier withheld (a cause
        logged long before the end, or on a warning line) stays withheld."""
        signature = self.table.get(verdict.signature) if verdict.signature else None
        if signature is None or verdict.from_context or verdict.severity is Severity.UNKNOWN:
            return verdict
        severity = signature.serving_severity if served else signature.startup_severity
        if severity is None or severity is verdict.severity:
            return verdict
        if severity is Severity.FATAL and verdict.confidence is Confidence.LOW:
            return verdict  # a weak line (a warning, a wrapper) is never made fatal
        if severity is Severity.UNKNOWN:
            # The table knows the crash and says its kind does not tell in this phase: no
            # inference from its words either (determinism.assess keeps a signature's basis).
            phase = "after serving" if served else "before the server ever served"
            return dataclasses.replace(
                verdict,
                severity=severity,
                basis=Basis.SIGNATURE,
                confidence=Confidence.MEDIUM,
                severity_reason=f"unknown (signature {signature.id}): {signature.title} "
                f"{phase}: it may or may not recur; halted only when the same crash repeats",
            )
        return dataclasses.replace(verdict, severity=severity)

    def _block(self, ann: Annotated, index: int) -> TracebackBlock | None:
        block_id = ann.block_of[index]
        return ann.blocks[block_id] if block_id >= 0 else None

    def _candidate(self, ann: Annotated, index: int, opened: int) -> _Candidate | None:
        """The line at `index` as a root-cause candidate, or None. A message a client could
        have written (see `clients_from`) is none; one request's failure (its handler's
        traceback) is context only."""
        if ann.roles[index] is Role.MESSAGE and _client_may_write(ann.lines[index], index, opened):
            return None
        block = self._block(ann, index)
        candidate = self._candidate_line(ann, index, block, opened)
        return _in_context(ann, block, candidate)

    def _candidate_line(
        self, ann: Annotated, index: int, block: TracebackBlock | None, opened: int
    ) -> _Candidate | None:
        role = ann.roles[index]
        if role not in _MATCHED_ROLES:
            return None
        if block is not None and block.ignored:
            return None
        line = ann.lines[index]
        if role is Role.MESSAGE and _CODE_LIKE.match(line.text):
            return None  # a source line of a traceback cut above it, not a message
        special = crash_form(ann, index) if role is Role.MESSAGE else None
        text = special or _with_details(ann, index, block, _cause_text(ann, index, block).strip())
        text = text[: self.max_line_chars]
        if not text:
            return None
        frames = [ann.lines[f].text for f in block.frames] if block is not None else []
        match = self.table.match(text, frames=frames)
        if match is None and text != line.text.strip():
            match = self.table.match(line.text.strip(), frames=frames)
        if match is not None:
            candidate = _from_match(index, text, match)
            if candidate is None or role is not Role.MESSAGE or candidate.tier != _TIER_CAUSE:
                return candidate
            if self.lexicon.coped(line.text):
                # A line saying the program coped and went on (SGLang's `Ignore import error
                # when loading <model>: ...`, at every start) ended nothing: the cause its words
                # name is not this crash's, and it ranks below every other warning.
                return _Candidate(_TIER_WARNING, -1, index, text, None)
            if line.level in _QUIET_LEVELS or _caught(line):
                # A cause's words in a line logged as information (a retry, a fallback) or in
                # an exception the program caught and went on from rank below an error; a
                # traceback's last line is the exception whatever its level.
                return dataclasses.replace(candidate, tier=_TIER_WARNING)
            return candidate
        return self._unlisted(ann, index, text, special is not None, opened)

    def _unlisted(
        self, ann: Annotated, index: int, text: str, special: bool, opened: int
    ) -> _Candidate | None:
        """A line no signature knows, ranked by its form and by what its words say.

        An exception, a crash form, an error-level message or a header that carries its
        cause is a candidate as it is, a wrapper if its words only point elsewhere. A quieter
        line (unlevelled, a warning) is one only for its words: see `_quiet`."""
        role, line = ann.roles[index], ann.lines[index]
        carried = carried_cause(line.text)
        caught = carried is not None and carried.caught
        message = role is Role.MESSAGE and _is_prose(line.text)
        error = message and line.level in _ERROR_LEVELS and not caught
        header = role is Role.HEADER and carried is not None  # `... method M: <cause>`
        loud = role is Role.EXCEPTION or special or error or header
        # Information is no cause, unless its words name one outright before the server
        # took requests (`_names_a_shortfall`).
        decisive = not loud and message and index < opened and self.lexicon.names_a_shortfall(text)
        if not loud and not (message and (line.level not in INFO_LEVELS or decisive)):
            return None
        kind = self.lexicon.line_kind(carried.cause if carried else text)
        if kind is Reads.POINTER:
            return _Candidate(_TIER_WRAPPER, 0, index, text, None)
        if decisive:
            # Its words name the cause outright: a "handled" reading beside them (`Use the
            # profiled value instead`, of a value below zero) copes with nothing.
            return _Candidate(_TIER_WARNING, 0, index, text, None)
        if not loud:
            return self._quiet(index, text, line, carried is not None, kind, opened)
        if error and kind is None and not special and _introduces(ann, index):
            # It only introduces what follows: it says less than a wrapper that reports.
            return _Candidate(_TIER_WRAPPER, -1, index, text, None)
        if role is Role.EXCEPTION or special:
            return _Candidate(_TIER_EXCEPTION, 0, index, text, None)
        # An error the program says it coped with (a retry) ranks below the errors.
        tier = _TIER_WARNING if kind is Reads.HANDLED else _TIER_ERROR
        return _Candidate(tier, 0, index, text, None)

    @staticmethod
    def _quiet(
        index: int, text: str, line: ParsedLine, carries: bool, kind: Reads | None, opened: int
    ) -> _Candidate | None:
        """An unlevelled line, or a warning that carries an exception, whose words read as a
        cause names it when nothing louder does (low confidence: it only leans). Once the
        server took requests only indeterminate words count (a watchdog's timeout): a client
        may have put any words in a line, and these are never evidence of determinism."""
        if line.level is not None and not carries:
            return None  # a warning in its own words is context, never a cause
        if kind not in CAUSE_READINGS or (index >= opened and kind is not Reads.INDETERMINATE):
            return None
        return _Candidate(_TIER_WARNING, 0, index, text, None)

    def _raise_statements(self, ann: Annotated) -> list[_Candidate]:
        """A traceback cut before its exception line still shows, in its innermost frame, the
        `raise X("...")` statement that raised it: that statement is the cause."""
        found: list[_Candidate] = []
        for block in ann.blocks:
            if block.ignored or block.exception is not None or not block.frames:
                continue
            code = block.code.get(block.frames[-1])
            if code is None or raise_statement(ann.lines[code].text) is None:
                continue
            text = ann.lines[code].text.strip()[: self.max_line_chars]
            match = self.table.match(text, frames=[ann.lines[f].text for f in block.frames])
            # With no words on the line, the statement names a class and no cause.
            tier = _TIER_WARNING if raise_without_message(text) else _TIER_EXCEPTION
            candidate = (
                _from_match(code, text, match)
                if match is not None
                else _Candidate(tier, 0, code, text, None)
            )
            if (candidate := _in_context(ann, block, candidate)) is not None:
                found.append(candidate)
        return found

    def _facts(self, ann: Annotated, best: _Candidate) -> CauseFacts:
        """What the chosen line and its traceback say beside the line's words."""
        block = self._block(ann, best.index)
        role, line = ann.roles[best.index], ann.lines[best.index]
        frames = [ann.lines[f].text for f in block.frames] if block is not None else []
        frame = frames[-1] if frames else None
        carried = carried_cause(line.text)
        raised = raise_statement(line.text) if role is Role.CODE else None
        if raised is not None:
            exception: str | None = raised
        elif carried is not None:
            exception = exception_name(carried.cause)
        elif role is Role.EXCEPTION or best.tier == _TIER_EXCEPTION:
            exception = exception_name(line.text.strip())
        else:
            exception = None
        return CauseFacts(
            words=carried.cause if carried else None,
            exception=exception,
            frame=frame,
            callers=tuple(frames[:-1]),
            raise_statement=raised is not None,
            pointer=best.tier == _TIER_WRAPPER,
        )

    def _verdict(
        self, ann: Annotated, best: _Candidate, crashed_blocks: list[TracebackBlock]
    ) -> Verdict:
        """Assemble the verdict around the chosen root-cause candidate."""
        signature = best.match.signature if best.match is not None else None
        captures = MappingProxyType(dict(best.match.captures)) if best.match is not None else EMPTY
        severity = signature.severity if signature else Severity.UNKNOWN
        if best.tier == _TIER_CONTEXT and severity is Severity.FATAL:
            severity = Severity.UNKNOWN  # an old error while serving is not proof of a loop
        return Verdict(
            signature=signature.id if signature else None,
            severity=severity,
            title=signature.title if signature else "Unrecognised crash",
            root_cause=best.text,
            crash_site=_crash_site(ann, self._block(ann, best.index)),
            captures=captures,
            remediation=signature.render_remediation(captures) if signature else None,
            packages=signature.packages if signature else (),
            fingerprint=fingerprint(best.text),
            crashed=True,
            notes=tuple(_notes(ann, best, crashed_blocks)),
            from_context=best.tier == _TIER_CONTEXT,
            confidence=_CONFIDENCE[best.tier],
            phase_hint=_phase_hint(ann, self._block(ann, best.index), crashed_blocks),
        )


def _caught(line: ParsedLine) -> bool:
    """The line reports an exception the program caught and went on from (a warning)."""
    carried = carried_cause(line.text) if "Failed to import" in line.text else None
    return carried is not None and carried.caught


def _in_context(
    ann: Annotated, block: TracebackBlock | None, candidate: _Candidate | None
) -> _Candidate | None:
    """One request's failure the server caught (its handler's traceback) is context only."""
    if candidate is None or block is None or not _caught_by_the_server(ann, block):
        return candidate
    return dataclasses.replace(candidate, tier=_TIER_CONTEXT)


def _introduces(ann: Annotated, index: int) -> bool:
    """The line only introduces what follows: the message `logger.exception` printed before
    its traceback, or a line ending in `:` (`Shard complete standard error output:`)."""
    return index in ann.intros or ann.lines[index].text.rstrip().endswith(":")


def _site_only(ann: Annotated, crashed: list[TracebackBlock]) -> CauseFacts:
    """With no cause line, the innermost frame of the last crashed traceback is all there is."""
    for block in reversed(crashed):
        if block.frames:
            frames = [ann.lines[f].text for f in block.frames]
            return CauseFacts(frame=frames[-1], callers=tuple(frames[:-1]))
    return NO_FACTS


def _raised_instead(ann: Annotated, best: _Candidate, candidates: list[_Candidate]) -> _Candidate:
    """In a chain, a message-less exception (`StopIteration`, its source line standing in for
    a message) says less than the exception raised from it: take that one, when it has a
    message and is not a generic wrapper."""
    block_id = ann.block_of[best.index]
    if block_id < 0 or ann.roles[best.index] is not Role.EXCEPTION:
        return best
    if ":" in ann.lines[best.index].text:
        return best  # it has a message of its own
    later = [
        c
        for c in candidates
        if c.tier >= _TIER_EXCEPTION
        and (b := ann.block_of[c.index]) >= 0
        and _chained_from(ann, b, block_id)
        and ":" in ann.lines[c.index].text
    ]
    return min(later, key=_Candidate.key) if later else best


def _reraised_in_the_same_words(
    ann: Annotated, best: _Candidate, candidates: list[_Candidate]
) -> _Candidate:
    """A library that re-raises a lower layer's exception in its own class with the same
    message (`raise HfHubHTTPError(str(e)) from e`, httpx's mapping of httpcore's errors) says
    the same cause in the words its callers know: take the last of such re-raises. A re-raise
    in other words (`Can't load the configuration of ...`) is a consequence and stays behind."""
    while True:
        words = _exception_words(ann, best.index)
        if words is None:
            return best
        again = [
            c
            for c in _reraises_of(ann, best, candidates)
            if _exception_words(ann, c.index) == words
        ]
        if not again:
            return best
        best = min(again, key=_Candidate.key)


def _reraises_of(
    ann: Annotated, best: _Candidate, candidates: list[_Candidate]
) -> list[_Candidate]:
    """The exception lines, ranked at least as high, of the tracebacks raised straight from
    `best`'s (`The above exception was the direct cause ...`, `During handling ...`); none
    when `best` is not a traceback's exception line."""
    block_id = ann.block_of[best.index]
    if block_id < 0 or ann.roles[best.index] is not Role.EXCEPTION:
        return []
    return [
        c
        for c in candidates
        if c.tier >= best.tier
        and (b := ann.block_of[c.index]) >= 0
        and ann.blocks[b].chained_from == block_id
        and ann.roles[c.index] is Role.EXCEPTION
    ]


def _exception_words(ann: Annotated, index: int) -> str | None:
    """The message of an exception line (what follows `Class: `), None for any other line."""
    if ann.roles[index] is not Role.EXCEPTION:
        return None
    name, colon, words = ann.lines[index].text.strip().partition(": ")
    return words.strip() if colon and words.strip() and " " not in name else None


def _chained_from(ann: Annotated, block_id: int, origin: int) -> bool:
    """True when traceback `block_id` was raised, directly or not, from traceback `origin`."""
    seen = 0
    current: int | None = ann.blocks[block_id].chained_from
    while current is not None and seen < len(ann.blocks):
        if current == origin:
            return True
        current = ann.blocks[current].chained_from
        seen += 1
    return False


def _as_context(candidate: _Candidate, line: LogLine, before_us: int) -> _Candidate:
    """A candidate logged while serving, long before the end, ranks below every other."""
    if line.realtime_us is None or line.realtime_us >= before_us:
        return candidate
    return dataclasses.replace(candidate, tier=_TIER_CONTEXT)


def _from_match(index: int, text: str, match: SignatureMatch) -> _Candidate | None:
    """A candidate for a matched line: None for noise, the wrapper tier for wrappers."""
    kind = match.signature.kind
    if kind == "noise":
        return None
    tier = _TIER_WRAPPER if kind == "wrapper" else _TIER_CAUSE
    return _Candidate(tier, match.signature.priority, index, text, match)


def _cause_text(ann: Annotated, index: int, block: TracebackBlock | None) -> str:
    """The line's text; for a message-less exception, the failing source line instead."""
    text = ann.lines[index].text
    if ann.roles[index] is not Role.EXCEPTION or ":" in text or block is None or not block.frames:
        return text
    code_index = block.code.get(block.frames[-1])
    if code_index is None:
        return text
    code = ann.lines[code_index].text.strip()
    if not code or code.startswith("^") or set(code) <= set("^~ "):
        return text  # the marker under the code, not the code
    # `raise TimeoutError` repeats the class name; the bare exception line reads better.
    return text if code.startswith("raise") else code


# An exception line that is only a header of its message (pydantic lists the errors on the
# following lines: "  Value error, Cannot find the config file for awq [type=value_error...";
# tvm's `Check failed: (status == cudaSuccess) is false:` is followed by what failed).
_HEADER_MESSAGE = re.compile(r"\d+ validation errors? for \w+\s*$|:\s*$")
_DETAILS_KEPT = 2


def _with_details(ann: Annotated, index: int, block: TracebackBlock | None, text: str) -> str:
    """A header-only exception line with the detail lines that say what is wrong."""
    if block is None or block.exception != index or not block.details:
        return text
    if _HEADER_MESSAGE.search(text) is None:
        return text
    details = [ann.lines[i].text.strip() for i in block.details[:_DETAILS_KEPT]]
    joined = " ".join(d for d in details if d)
    return f"{text} {joined}" if text.endswith(":") else f"{text}: {joined}"


def _is_prose(text: str) -> bool:
    """False for indented code or marker fragments of a cut traceback (`    x = f(`, `^^^`)."""
    if not text or text[0].isspace() or text.startswith(("^", ")", "]")):
        return False
    return any(ch.isalpha() for ch in text[:80])


def _crash_site(ann: Annotated, block: TracebackBlock | None) -> str | None:
    """The frame (and its code line) of the root cause's traceback a reader acts on."""
    if block is None or not block.frames:
        return None
    chosen = _deepest(ann, block.frames, _MODEL_PATHS)
    if chosen is None:
        chosen = _deepest(ann, block.frames, _SERVER_PATHS)
    if chosen is None:
        chosen = block.frames[-1]
    site = ann.lines[chosen].text.strip()
    code_index = block.code.get(chosen)
    if code_index is not None:
        code = ann.lines[code_index].text.strip()
        if code and not code.startswith("^"):
            site = f"{site}: {code}"
    return site


# Functions whose frames say where the server was when it crashed (the engine files'
# startup_frames and serving_frames). Startup wins over serving.
_STARTUP_FRAMES: re.Pattern[str]
_SERVING_FRAMES: re.Pattern[str]
_REQUEST_HANDLERS: re.Pattern[str]  # the engine files' request_frames
_SELF_KILL: re.Pattern[str]  # the engine files' self_kill
_SELF_KILL_TAIL = 20  # its main process's last lines it is looked for in
_NEVER = r"(?!)"


def _any_of(patterns: tuple[str, ...]) -> str:
    return "|".join(f"(?:{pattern})" for pattern in patterns) or _NEVER


def _use_engines(engines: Engines) -> None:
    """What the engine files say of requests, paths and frames (profiles.follow)."""
    global _REQUEST_LOG, _SERVER_PATHS, _MODEL_PATHS, _STARTUP_FRAMES, _SERVING_FRAMES
    global _REQUEST_HANDLERS, _SELF_KILL
    _REQUEST_LOG = re.compile(_any_of(engines.request_lines))
    _SELF_KILL = re.compile(_any_of(engines.self_kill))
    _REQUEST_HANDLERS = re.compile(rf"\bin (?:{_any_of(engines.request_frames)})\b")
    _SERVER_PATHS = engines.server_paths
    _MODEL_PATHS = engines.model_paths
    _STARTUP_FRAMES = re.compile(rf"\bin (?:{_any_of(engines.startup_frames)})\b")
    _SERVING_FRAMES = re.compile(rf"\bin (?:{_any_of(engines.serving_frames)})\b")


follow(_use_engines)


def _phase_hint(
    ann: Annotated, block: TracebackBlock | None, crashed: list[TracebackBlock]
) -> str | None:
    """ "startup" or "serving" from the frames of the crash's traceback, when they tell."""
    blocks = [block] if block is not None and block.frames else crashed
    if any(_handles_a_request(ann, b) for b in blocks):
        return "serving"  # a request was being handled: it served, serving line or not
    frames = [ann.lines[f].text for b in blocks for f in b.frames]
    if any(_STARTUP_FRAMES.search(f) for f in frames):
        return "startup"
    if any(_SERVING_FRAMES.search(f) for f in frames):
        return "serving"
    return None


def clients_from(lines: Sequence[ParsedLine]) -> int:
    """The index of the first line that shows the server taking requests (its serving line,
    or a request logged), len(lines) when none does: before it no client could write a line."""
    for index, line in enumerate(lines):
        if _REQUEST_LOG.search(line.text) or is_serving_line(line.text):
            return index
    return len(lines)


def _killed_itself(invocation: Invocation) -> bool:
    """Its main process died of SIGKILL right after the engine said it kills its own process
    tree (SGLang, when a child fails: `kill_process_tree called: ..., include_parent=True`)."""
    if invocation.exit_code != "killed" or invocation.exit_status != signal.SIGKILL:
        return False
    tail = invocation.lines[-_SELF_KILL_TAIL:]
    return any(_SELF_KILL.search(line.text) for line in tail)


def _client_may_write(line: ParsedLine, index: int, opened: int) -> bool:
    """True for a line a client of the API could have put in the journal: a request log line,
    or information once the server took requests (`opened`, from `clients_from`)."""
    return bool(_REQUEST_LOG.search(line.text)) or (index >= opened and line.level in INFO_LEVELS)


def _caught_by_the_server(ann: Annotated, block: TracebackBlock) -> bool:
    """True when the ASGI server or its web framework caught the traceback (their frames
    are in it): it ended one request, and the server went on."""
    return any(m in ann.lines[f].text for f in block.frames for m in _REQUEST_FRAMES)


def _handles_a_request(ann: Annotated, block: TracebackBlock) -> bool:
    """True when the traceback went through a request's handling: caught by the server, or
    through an engine file's request_frames (an error there may still end the server)."""
    return _caught_by_the_server(ann, block) or any(
        _REQUEST_HANDLERS.search(ann.lines[f].text) for f in block.frames
    )


def _deepest(ann: Annotated, frames: list[int], markers: tuple[str, ...]) -> int | None:
    """The last frame whose path contains one of `markers`."""
    for index in reversed(frames):
        if any(marker in ann.lines[index].text for marker in markers):
            return index
    return None


def _notes(ann: Annotated, best: _Candidate, crashed: list[TracebackBlock]) -> list[str]:
    """Short facts a reader of the verdict wants next to the root cause."""
    notes: list[str] = []
    processes = {b.process for b in crashed}
    if len(processes) > 1:
        notes.append(f"{len(processes)} processes printed a traceback")
    if best.tier == _TIER_CONTEXT:
        notes.append(
            "the only error was logged while serving, long before the end: it may not be what "
            "ended the invocation"
        )
    if best.tier == _TIER_WRAPPER:
        notes.append("only a generic wrapper was found; the real cause is in another log")
    elif best.match is None and best.tier == _TIER_ERROR:
        notes.append("no traceback exception found; root cause is the first error message")
    if ann.processes[best.index] not in ("main", None):
        notes.append(f"root cause printed by process {ann.processes[best.index]}")
    return notes


def _no_cause(ann: Annotated, crashed_blocks: list[TracebackBlock]) -> Verdict:
    """The verdict when no line could be the root cause (its frames may still tell the phase)."""
    if crashed_blocks:
        return Verdict(
            signature=None,
            severity=Severity.UNKNOWN,
            title="Unrecognised crash",
            root_cause=None,
            crashed=True,
            captures=EMPTY,
            notes=("a traceback was printed but its exception line is missing (cut off)",),
            phase_hint=_phase_hint(ann, None, crashed_blocks),
        )
    return Verdict(
        signature=None, severity=Severity.UNKNOWN, title="No crash found", root_cause=None
    )


def _not_a_run(ending: Ending) -> Verdict:
    """The verdict of a start that never ran the server."""
    title, note = {
        Ending.SKIPPED: (
            "Start skipped by its ExecCondition gate",
            "the gate refused the start (the unit is quarantined); no server ran",
        ),
        Ending.GATE_STOPPED: (
            "Stopped while its ExecCondition gate ran",
            "a stop job ended the start before the server ran",
        ),
        Ending.START_LIMIT: (
            "systemd gave up restarting the unit",
            "start-limit-hit: systemd refuses further starts until `systemctl reset-failed`",
        ),
    }[ending]
    return Verdict(
        signature=None, severity=Severity.UNKNOWN, title=title, root_cause=None, notes=(note,)
    )


def _prefer_the_end(verdict: Verdict, invocation: Invocation) -> Verdict:
    """An end systemd explains (an OOM kill, a signal) beats an error logged long before it."""
    if invocation.oom_killed:
        cause = (
            invocation.end_message or "A process of this unit has been killed by the OOM killer."
        )
        title = "Killed by the out-of-memory killer"
    elif invocation.exit_code in ("killed", "dumped"):
        cause = invocation.end_message or f"Main process {invocation.exit_code}"
        title = "Killed by a signal"
    else:
        return verdict
    return Verdict(
        signature=None,
        severity=Severity.UNKNOWN,
        title=title,
        root_cause=cause,
        crashed=True,
        fingerprint=fingerprint(cause),
        notes=(f"logged earlier while serving (context, not the cause): {verdict.root_cause}",),
    )


def _failed_without_cause(
    verdict: Verdict,
    invocation: Invocation,
    is_noise: Callable[[str], bool],
    reads_as_cause: Callable[[str], bool],
    *,
    skip: Container[int] = (),
) -> tuple[Verdict, bool]:
    """A failed invocation always names its best candidate line, and how sure that is: never
    "No crash found". With no line at all, its lines were lost (or it printed none). Also
    whether that line is a warning whose words the lexicon reads as a cause."""
    warned = False
    if invocation.total_lines == 0 or invocation.suppressed_lines > invocation.total_lines:
        title = "Crash whose log lines were lost"
        note = (
            "no line of this invocation reached the journal"
            if invocation.total_lines == 0
            else f"journald dropped {invocation.suppressed_lines} of its lines"
        ) + " (journald's rate limit drops lines: check `Suppressed N messages` around it)"
        cause = invocation.end_message or _how_it_ended(invocation)
    else:
        title = "Failed without an error line"
        found = _guess(invocation.lines, is_noise, reads_as_cause, skip=skip)
        guess, last = found.text, found.last
        if invocation.oom_killed or invocation.exit_code in ("killed", "dumped"):
            # A signal or the OOM killer ended it: that is the cause the journal knows.
            guess, last = None, guess or last
        cause = guess or invocation.end_message or _how_it_ended(invocation)
        warned = guess is not None and found.level == "WARNING" and reads_as_cause(guess)
        if warned:
            note = (
                f"none of its {invocation.total_lines} lines reads as an error; the root cause "
                "is the last warning, whose words name one"
            )
        elif guess is not None:
            note = (
                f"none of its {invocation.total_lines} lines reads as an error; the root cause "
                "is the last line that looks like one (a guess)"
            )
        else:
            note = (
                f"none of its {invocation.total_lines} lines reads as an error or trouble: the "
                f"cause is not in the journal; its last line: {last or '(none)'}"
            )
    verdict = dataclasses.replace(
        verdict,
        title=title,
        root_cause=cause,
        crashed=True,
        confidence=Confidence.LOW,
        fingerprint=verdict.fingerprint or (fingerprint(cause) if cause else None),
        notes=(*verdict.notes, note),
    )
    return verdict, warned


def _how_it_ended(invocation: Invocation) -> str:
    """PID 1's words for an exit whose message is not in the journal."""
    code = invocation.exit_code or "exited"
    status = "?" if invocation.exit_status is None else invocation.exit_status
    return f"Main process {code}, status={status} (result {invocation.result or 'unknown'})"


_MARKER_CHARS = set("^~ ")
_TRACEBACK_GLUE = (
    "Traceback (most recent call last)",
    "During handling of the above exception",
    "The above exception was the direct cause",
)
_LOOKS_BAD = re.compile(
    r"(?:Error|Exception)\b|\b(?:[Ee]rrors?|ERROR|[Ff]ail(?:ed|ure|s)?|CRITICAL|FATAL|[Ff]atal|"
    r"[Aa]bort(?:ed|ing)?|[Kk]illed|panicked|[Ss]egmentation fault)\b"
)


def best_guess(
    lines: Sequence[LogLine],
    is_noise: Callable[[str], bool] = lambda _: False,
    reads_as_cause: Callable[[str], bool] = lambda _: False,
    *,
    skip: Container[int] = (),
) -> tuple[str | None, str | None]:
    """The last line that looks like trouble (error words, or, before the server took
    requests, words the lexicon reads as a cause), and the last line that says anything, both
    without their prefixes.

    Skipped: blank lines, caret markers, a traceback's frames, their source lines and its glue
    (a traceback cut before its exception names no cause), lines the table calls noise, and
    information (a request log quotes whatever a client sent)."""
    found = _guess(lines, is_noise, reads_as_cause, skip=skip)
    return found.text, found.last


@dataclass(frozen=True, slots=True)
class _Guess:
    text: str | None  # the last line that looks like trouble
    last: str | None  # the last line that says anything
    level: str | None  # the guessed line's level, when its prefix names one


def _guess(
    lines: Sequence[LogLine],
    is_noise: Callable[[str], bool],
    reads_as_cause: Callable[[str], bool],
    *,
    skip: Container[int] = (),
) -> _Guess:
    """`best_guess`, with the guessed line's level."""
    parsed = [parse_line(line) for line in lines]
    texts = [line.text.strip() for line in parsed]
    after_frame = _after_frame(texts)
    opened = clients_from(parsed)
    last: str | None = None
    for index in range(len(texts) - 1, -1, -1):
        text = texts[index]
        if not text or set(text) <= _MARKER_CHARS or text.startswith('File "'):
            continue
        if index in skip or _client_may_write(parsed[index], index, opened):
            continue  # a request's own error (`skip`) or a client's words
        if after_frame[index] or text.startswith(_TRACEBACK_GLUE) or is_noise(text):
            continue
        if last is None:
            last = text
        if _LOOKS_BAD.search(text) or (index < opened and reads_as_cause(text)):
            return _Guess(text, last, parsed[index].level)
    return _Guess(None, last, None)


def _after_frame(texts: Sequence[str]) -> list[bool]:
    """Per text: the nearest non-blank text before it is a traceback frame (`File "..."`)."""
    flags: list[bool] = []
    previous = ""
    for text in texts:
        flags.append(previous.startswith('File "'))
        if text:
            previous = text
    return flags


def _loss_notes(invocation: Invocation, verdict: Verdict) -> list[str]:
    """What the verdict could not see: lines dropped by the caps and by journald."""
    notes: list[str] = []
    if invocation.dropped_lines:
        kept = invocation.total_lines - invocation.dropped_lines
        notes.append(
            f"{kept} of {invocation.total_lines} lines kept for classification (the latest "
            f"error lines of each process; {invocation.dropped_lines} dropped by the memory caps)"
        )
    lost = invocation.lines_lost()
    # A run with no line at all is said so by its title (_failed_without_cause).
    said = invocation.suppressed_lines or verdict.severity is Severity.UNKNOWN
    if lost is not None and said and invocation.total_lines:
        notes.append(lost)
    return notes
