"""Strip log prefixes from service lines and reassemble Python tracebacks per process.

An inference server's journal interleaves the output of several processes (API server, engine
core, one worker per GPU), each line wrapped in one or more prefixes: the syslog header of a
plain-text journal export, a Ray or vLLM `(Name pid=N)` tag, a logger's `LEVEL date [file:line]`,
a docker-compose `service |` column, NCCL's `host:pid:tid [dev]`, and so on. The classifier
needs the bare text, which process printed it (tracebacks of two workers arrive interleaved
line by line) and the log level. This module does only that and knows nothing of signatures.

`parse_line` handles one line; `annotate` runs a small state machine per process that labels
every line (frame, code, exception, ...) and groups traceback lines into `TracebackBlock`s,
linking chained tracebacks ("The above exception was the direct cause ...") and noting the
message that introduced one (`logger.exception("EngineCore failed to start.")`).
`carried_cause` reads the wrappers that carry their cause inside one line (`Exception in worker
W while processing method M: <cause>`, `Failed to import from M with ImportError('...')`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from ..engines.profiles import Engines, follow
from ..model import LogLine

# Prefix families, each an anchored regex with a named outer group (the handlers read
# `m.lastgroup`). `parse_line` applies them repeatedly because prefixes nest (journal header,
# then Ray actor tag, then vLLM process tag, then logger format). They are grouped by the
# character a prefix can start with, so a line tries only the few families that can match:
# this keeps parsing near 10 µs a line.
_SYSLOG = (
    r"(?P<syslog>[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \S+ [^\s\[:]+(?:\[(?P<syslog_pid>\d+)\])?: ?)"
)
# A date and time, then a space or a tab (Ray's own log files: `2025-03-19 14:58:50,134\tINFO`).
_ISO = r"(?P<iso>\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d)?(?:[ \t]|$))"
_DMESG = r"(?P<dmesg>\[ *\d+\.\d+\] ?)"
_KERNEL = r"(?P<kernel>kernel: )"
_PROC = (
    r"(?P<proc> *\((?P<proc_name>[^()]*(?:\([^()]*(?:\([^()]*\))?[^()]*\))?[^()]*?)"
    r"(?: rank=\d+)? pid=(?P<proc_pid>\d+)(?:, ip=[\d.]+)?\) ?)"
)
_RAYLET = r"(?P<raylet>\(raylet\) ?(?:\[[\d :,-]+ (?P<raylet_level>[IWEF]) \d+ \d+\] ?)?)"
_RANK = r"(?P<rank>\[rank(?P<rank_no>\d+)\]: ?)"
# A CI runner's `[2026-01-26T17:25:37Z] ` before everything else.
_CI_TIME = r"(?P<citime>\[\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z\] )"
_COMPOSE = r"(?P<compose>[a-zA-Z0-9][\w.-]* +\| ?)"

# Custom Python logging `2024-12-19 21:40:35 ERROR 56542 [file.py:64] ` (date already gone).
_CUSTOM = (
    r"(?P<custom>(?P<custom_level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<custom_pid>\d+) "
    r"\[[\w./-]+:\d+\] ?)"
)
# Ray's own `2025-03-21 19:23:35,946 INFO file.py:2115 -- ` (date already gone).
_RAY = r"(?P<ray>(?P<ray_level>DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w./-]+:\d+ -- )"
# A cloud log export `ERROR 2024-07-26T09:57:23.184660434Z ` (level, then an RFC 3339 time).
_CLOUD = (
    r"(?P<cloud>(?P<cloud_level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \d{4}-\d\d-\d\dT"
    r"\d\d:\d\d:\d\d(?:\.\d+)?Z )"
)
# Python's logging.basicConfig format `2025-03-08 02:04:48,697 - name - INFO - ` (date gone).
_PYLOG = r"(?P<pylog>- [\w.<>-]+ - (?P<pylog_level>DEBUG|INFO|WARNING|ERROR|CRITICAL) - )"
# glog from torch `W1223 23:34:22.775000 1116 torch/utils/cpp_extension.py:2425] `.
_GLOG = (
    r"(?P<glog>(?P<glog_level>[IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +(?P<glog_pid>\d+) "
    r"[\w./-]+:\d+\] ?)"
)
# torch c10d `[E ProcessGroupNCCL.cpp:475] `, `[W1230 23:19:23.97 ProcessGroupNCCL.cpp:1250] `.
_C10D = r"(?P<c10d>\[(?P<c10d_level>[IWEF])(?:\d{3,4} [\d:.]+)? [\w./-]+:\d+\] ?)"
# NCCL `host:pid:tid [dev] file.cc:N NCCL WARN ...` (the text keeps `NCCL WARN`).
_NCCL = r"(?P<nccl>[\w.-]+:(?P<nccl_pid>\d+):\d+ \[\d+\] (?:[\w./-]+:\d+ )?(?=NCCL ))"
# fastchat's model worker `2024-02-20 21:46:23 | ERROR | stderr | ` (date already gone).
_PIPE = r"(?P<pipe>\| (?P<pipe_level>DEBUG|INFO|WARNING|ERROR|CRITICAL) \| (?:[\w.-]+ \| )?)"
# Python's warnings module `/x/dispatcher.py:138: FutureWarning: ...` (the text keeps the
# category): a warning, whatever the journal's priority says.
_PYWARN = r"(?P<pywarn>[^\s:]+\.pyx?:\d+: (?=[A-Z]\w*Warning: ))"


def _alt(*patterns: str) -> re.Pattern[str]:
    return re.compile("|".join(patterns))


# The families each class of first character tries, an engine file's prefixes first (the
# engines' own formats, config/engines/*.toml: vLLM's, SGLang's, TGI's).
_FAMILIES = {
    ("outer", "paren"): (_PROC, _RAYLET),
    ("outer", "bracket"): (_DMESG, _RANK, _CI_TIME),
    ("outer", "digit"): (_ISO,),
    ("outer", "letter"): (_SYSLOG, _KERNEL),
    ("inner", "level"): (_CLOUD, _CUSTOM, _RAY, _GLOG),
    ("inner", "bracket"): (_C10D, _RANK),
    # A process tag can follow a logger's prefix too (Ray's actor tag inside a vLLM line).
    ("inner", "paren"): (_PROC,),
    ("inner", "dash"): (_PYLOG,),
    ("inner", "pipe"): (_PIPE,),
}
_COMPOSE_RX = re.compile(_COMPOSE)
_NCCL_RX = re.compile(_NCCL)
_PYWARN_RX = re.compile(_PYWARN)


@dataclass(frozen=True, slots=True)
class _EnginePrefix:
    """An engine file's prefix, matched: which of its groups name the level and the process."""

    level: str | None
    process: str | None
    pid: str | None
    levels: Mapping[str, str]

    def read(
        self, m: re.Match[str], process: str | None, level: str | None
    ) -> tuple[str | None, str | None]:
        """The process and level after this prefix (each as before when it names none)."""
        if self.level is not None and (word := m.group(self.level)) is not None:
            level = self.levels.get(word, level)
        if self.process is not None and (name := m.group(self.process)):
            process = name.strip()
        if self.pid is not None and (pid := m.group(self.pid)):
            process = f"pid:{pid}"
        return process, level


_OUTER_PAREN: re.Pattern[str]
_OUTER_BRACKET: re.Pattern[str]
_OUTER_DIGIT: re.Pattern[str]
_OUTER_ALPHA: re.Pattern[str]
_INNER_LEVEL: re.Pattern[str]
_INNER_BRACKET: re.Pattern[str]
_INNER_PAREN: re.Pattern[str]
_INNER_DASH: re.Pattern[str]
_INNER_PIPE: re.Pattern[str]
_ENGINE_PREFIXES: Mapping[str | None, _EnginePrefix] = {}


def _use_engines(engines: Engines) -> None:
    """Compile each family with the engine files' prefixes of its place in front."""
    global _OUTER_PAREN, _OUTER_BRACKET, _OUTER_DIGIT, _OUTER_ALPHA
    global _INNER_LEVEL, _INNER_BRACKET, _INNER_PAREN, _INNER_DASH, _INNER_PIPE, _ENGINE_PREFIXES
    compiled = {
        place: _alt(
            *(r.grouped for r in engines.prefixes if (r.position, r.starts) == place), *family
        )
        for place, family in _FAMILIES.items()
    }
    _ENGINE_PREFIXES = {
        r.kind: _EnginePrefix(r.group("level"), r.group("process"), r.group("pid"), r.levels)
        for r in engines.prefixes
    }
    _OUTER_PAREN = compiled["outer", "paren"]
    _OUTER_BRACKET = compiled["outer", "bracket"]
    _OUTER_DIGIT = compiled["outer", "digit"]
    _OUTER_ALPHA = compiled["outer", "letter"]
    _INNER_LEVEL = compiled["inner", "level"]
    _INNER_BRACKET = compiled["inner", "bracket"]
    _INNER_PAREN = compiled["inner", "paren"]
    _INNER_DASH = compiled["inner", "dash"]
    _INNER_PIPE = compiled["inner", "pipe"]


follow(_use_engines)


def _match_outer(text: str, pos: int) -> re.Match[str] | None:
    """An outer prefix (journal, container, Ray or vLLM process tag) at `pos`."""
    ch = text[pos : pos + 1]
    if ch in ("(", " "):
        return _OUTER_PAREN.match(text, pos)
    if ch == "[":
        return _OUTER_BRACKET.match(text, pos)
    m = None
    if ch.isdigit():
        m = _OUTER_DIGIT.match(text, pos)
    elif ch.isalpha():
        m = _OUTER_ALPHA.match(text, pos)
    if m is None and ch.isalnum() and "|" in text:
        m = _COMPOSE_RX.match(text, pos)
    return m


def _match_inner(text: str, pos: int) -> re.Match[str] | None:
    """A logger-format prefix (level, time, file:line) at `pos`, after optional spaces."""
    start = pos
    while text.startswith(" ", start):
        start += 1
    ch = text[start : start + 1]
    m = None
    if ch in ("D", "I", "W", "E", "C", "F"):
        m = _INNER_LEVEL.match(text, start)
    elif ch == "[":
        m = _INNER_BRACKET.match(text, start)
    elif ch == "(":
        m = _INNER_PAREN.match(text, start)
    elif ch == "-":
        m = _INNER_DASH.match(text, start)
    elif ch == "|":
        m = _INNER_PIPE.match(text, start)
    if m is None and ch.isalnum() and "NCCL " in text:
        m = _NCCL_RX.match(text, start)
    if m is None and ch and not ch.isspace() and "Warning: " in text:
        m = _PYWARN_RX.match(text, start)
    return m


# An escape sequence (CSI), or a colour code pasted without its ESC (`[36m`, `[0;36m`).
_ANSI = re.compile(r"\x1b\[[\d;?]*[A-Za-z]|\x1b?\[\d{1,3}(?:;\d{1,3})*m")
# Found from its `[`, the spaces before it stripped apart: a leading `\s*` made the search
# quadratic on a long run of spaces (0.9 s for 16k).
_REPEATED = re.compile(r"\[repeated \d+x across cluster\]\s*$")
# The levels of information: what a program says it is doing, never what went wrong (and a
# request log at these levels quotes whatever a client sent).
INFO_LEVELS = frozenset({"DEBUG", "INFO"})
_LEVELS = {
    "DEBUG": "DEBUG",
    "INFO": "INFO",
    "WARNING": "WARNING",
    "ERROR": "ERROR",
    "CRITICAL": "CRITICAL",
    "I": "INFO",
    "W": "WARNING",
    "E": "ERROR",
    "F": "CRITICAL",
}
_MAX_PREFIXES = 8


@dataclass(frozen=True, slots=True)
class ParsedLine:
    """One service line without its prefixes: text, the process that printed it, its level."""

    text: str
    process: str | None  # from a prefix (pid, worker rank), else the journal pid, else None
    level: str | None  # DEBUG | INFO | WARNING | ERROR | CRITICAL, when a prefix names one


def _clean(raw: str) -> str:
    """Drop line endings, literal `^M`, ANSI colour codes and Ray's dedup suffix."""
    text = raw.rstrip("\r\n")
    if text.endswith("^M"):
        text = text[:-2]
    text = text.rstrip("\r")
    # A terminal's caret notation of ESC (`^[`), as a CI log viewer pastes colour codes.
    # Pasted with the colour parameters lost: only the `^[` marks are left, where they stood.
    if "^[" in text:
        text = text.replace("^[", "")
    # Colour codes (Ray's actor tags, vLLM's levels) arrive as ESC sequences or, pasted, as
    # bare `[36m` ... `[0m` remnants, a reset or not, anywhere in the line.
    if "[" in text and ("\x1b" in text or _ANSI.search(text) is not None):
        text = _ANSI.sub("", text)
        if "across cluster]" in text and (m := _REPEATED.search(text)) is not None:
            text = text[: m.start()].rstrip()
    return text


def _outer(
    m: re.Match[str], process: str | None, level: str | None
) -> tuple[str | None, str | None]:
    """Apply one outer prefix's process and level to what is known so far."""
    kind = m.lastgroup
    if kind == "syslog" and process is None and m.group("syslog_pid"):
        process = f"pid:{m.group('syslog_pid')}"
    elif kind == "proc":
        process = f"pid:{m.group('proc_pid')}"
    elif kind == "raylet":
        process = "raylet"
        if m.group("raylet_level"):
            level = _LEVELS[m.group("raylet_level")]
    elif kind == "rank":
        process = f"rank{m.group('rank_no')}"
    elif (engine := _ENGINE_PREFIXES.get(kind)) is not None:
        process, level = engine.read(m, process, level)
    return process, level


_INNER_LEVEL_GROUP = {
    "pipe": "pipe_level",
    "cloud": "cloud_level",
    "pylog": "pylog_level",
    "custom": "custom_level",
    "ray": "ray_level",
    "glog": "glog_level",
    "c10d": "c10d_level",
}


def _inner(m: re.Match[str], process: str | None) -> tuple[str | None, str | None]:
    """The process and level named by a logger-format prefix."""
    kind = m.lastgroup or ""
    if (engine := _ENGINE_PREFIXES.get(kind)) is not None:
        return engine.read(m, process, None)
    level_group = _INNER_LEVEL_GROUP.get(kind)
    level = _LEVELS[m.group(level_group)] if level_group else None
    if kind == "custom":
        process = f"pid:{m.group('custom_pid')}"
    elif kind == "glog":
        process = f"pid:{m.group('glog_pid')}"
    elif kind == "nccl":
        process = f"pid:{m.group('nccl_pid')}"
        # NCCL logs at INFO and WARN only: a WARN line is its report of a failure.
        level = "ERROR" if m.string.startswith("NCCL WARN", m.end()) else "INFO"
    elif kind == "proc":
        process = f"pid:{m.group('proc_pid')}"
    elif kind == "rank":
        process = f"rank{m.group('rank_no')}"
    elif kind == "pywarn":
        level = "WARNING"
    return process, level


@dataclass(frozen=True, slots=True)
class _Prefix:
    """What stripping found at the start of a line: length, process, level."""

    end: int
    process: str | None
    level: str | None
    cacheable: bool  # ends in a logger prefix and a space, so a line sharing it parses alike


def _inner_loop(text: str, pos: int, process: str | None, level: str | None) -> _Prefix:
    """Strip logger-format prefixes from `pos` on."""
    cacheable = False
    for _ in range(_MAX_PREFIXES):
        m = _match_inner(text, pos)
        if m is None or m.end() == pos:
            break
        process, inner_level = _inner(m, process)
        level = inner_level or level
        pos = m.end()
        cacheable = m.lastgroup != "nccl" and text.endswith(" ", 0, pos)
    return _Prefix(pos, process, level, cacheable)


def _strip(text: str) -> _Prefix:
    """Strip every known prefix from a cleaned line."""
    process: str | None = None
    level: str | None = None
    pos = 0
    for _ in range(_MAX_PREFIXES):
        m = _match_outer(text, pos)
        if m is None or m.end() == pos:
            break
        process, level = _outer(m, process, level)
        pos = m.end()
    return _inner_loop(text, pos, process, level)


def _finish(text: str, prefix: _Prefix, line: LogLine) -> ParsedLine:
    """The parsed line, with the journal's pid and priority as fallbacks."""
    process, level = prefix.process, prefix.level
    if process is None and line.pid is not None:
        process = f"pid:{line.pid}"
    if level is None and line.priority is not None and line.priority <= 3:
        level = "ERROR"
    return ParsedLine(text=text[prefix.end :], process=process, level=level)


def parse_line(line: LogLine) -> ParsedLine:
    """Strip every known prefix from `line.text`; see the corpus README's table of formats."""
    text = _clean(line.text)
    return _finish(text, _strip(text), line)


def parse_lines(lines: Sequence[LogLine]) -> list[ParsedLine]:
    """`parse_line` over a sequence, reusing the previous line's prefix when it repeats.

    Every line of a logged traceback carries the same prefix (journal header, process tag,
    `ERROR date [file:line] `), so re-parsing it is the bulk of the work on a crash log.
    """
    result: list[ParsedLine] = []
    last: _Prefix | None = None
    last_text = ""
    for line in lines:
        text = _clean(line.text)
        if last is not None and text.startswith(last_text):
            prefix = _inner_loop(text, last.end, last.process, last.level)
            prefix = _Prefix(prefix.end, prefix.process, prefix.level, True)
        else:
            prefix = _strip(text)
            if prefix.cacheable:
                last, last_text = prefix, text[: prefix.end]
        result.append(_finish(text, prefix, line))
    return result


class Role(Enum):
    """What a line is, seen from the traceback state machine."""

    MESSAGE = "message"  # an ordinary log message
    HEADER = "header"  # `Traceback (most recent call last):`, possibly after a message
    FRAME = "frame"  # `File "...", line N, in fn`
    CODE = "code"  # the source line or the `^^^^` marker under a frame
    EXCEPTION = "exception"  # `SomeError: message` ending a traceback
    DETAIL = "detail"  # further lines of the exception message
    CHAIN = "chain"  # `The above exception was the direct cause ...` / `During handling ...`
    IGNORED = "ignored"  # `Exception ignored in: ...` (a destructor's traceback follows)
    BLANK = "blank"


@dataclass(slots=True)
class TracebackBlock:
    """One Python traceback of one process: line indices of its parts."""

    process: str
    header: int | None
    frames: list[int] = field(default_factory=list)
    code: dict[int, int] = field(default_factory=dict)  # frame index -> its first code line
    exception: int | None = None
    details: list[int] = field(default_factory=list)
    ignored: bool = False  # printed by `Exception ignored in:`, never a crash
    chained_from: int | None = None  # block id of the traceback this one was raised from
    # The message that introduced it: `logger.exception(msg)` prints msg, then the traceback
    # (or `msg: Traceback (most recent call last):` on one line, the header itself).
    intro: int | None = None


@dataclass(slots=True)
class Annotated:
    """All lines of an invocation with their roles and traceback blocks."""

    lines: list[ParsedLine]
    processes: list[str]  # effective process key per line
    roles: list[Role]
    block_of: list[int]  # block id per line, -1 outside tracebacks
    blocks: list[TracebackBlock]
    intros: frozenset[int] = frozenset()  # lines that introduced a traceback (block.intro)


# `File "x.py", line 12, in fn`; Python's faulthandler writes `File "x.py", line 12 in fn`.
_FRAME = re.compile(r'\s*File "[^"]*"(?:, line \d+)?(?:,? in \S.*)?$')
_TB_HEADER = "Traceback (most recent call last):"
_CHAIN_MARKERS = (
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
)
# An exception line: dotted name with a capitalised last part, then `: message` or nothing.
_EXC_IN_TB = re.compile(r"(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?::(?: .*)?)?$")
# Outside a traceback only names that look like exceptions count (`Note: ...` is prose).
_EXC_BARE = re.compile(
    r"(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Timeout|Failure|Fault)"
    r"(?:: .*)?$"
)
_MAX_DETAILS = 12
_DEFAULT_PROCESS = "main"


@dataclass(slots=True)
class _State:
    """Where one process's traceback parser is."""

    block: int = -1  # open block id
    phase: str = "none"  # none | frames | message
    exc_level: str | None = None
    pending_chain: int | None = None  # block id a following traceback is chained from
    pending_ignored: bool = False
    message: int | None = None  # this process's previous line, when it was a message


def is_exception_line(text: str, *, in_traceback: bool) -> bool:
    """True when `text` reads as a Python exception line (`ValueError: ...`)."""
    if not text or text[0].isspace():
        return False
    pattern = _EXC_IN_TB if in_traceback else _EXC_BARE
    return pattern.match(text) is not None


def _continues_traceback(text: str) -> bool:
    """True for un-prefixed text that can only belong to an open traceback."""
    return (
        not text
        or text[0].isspace()
        or text.startswith(("File ", _TB_HEADER))
        or text in _CHAIN_MARKERS
        or is_exception_line(text, in_traceback=True)
    )


class _Annotator:
    """Per-process traceback state machine over a whole invocation."""

    def __init__(self, lines: list[ParsedLine]) -> None:
        self.lines = lines
        self.states: dict[str, _State] = {}
        self.blocks: list[TracebackBlock] = []
        self.processes: list[str] = []
        self.roles: list[Role] = []
        self.block_of: list[int] = []
        self._last_process = _DEFAULT_PROCESS

    def run(self) -> Annotated:
        """Label every line; return the result."""
        for line in self.lines:
            process = self._process_of(line)
            state = self.states.setdefault(process, _State())
            role = self._step(len(self.roles), line, state, process)
            state.message = len(self.roles) if role is Role.MESSAGE else None
            self.processes.append(process)
            self.roles.append(role)
            self.block_of.append(state.block if role not in (Role.MESSAGE, Role.CHAIN) else -1)
            self._last_process = process
        intros = frozenset(b.intro for b in self.blocks if b.intro is not None)
        return Annotated(self.lines, self.processes, self.roles, self.block_of, self.blocks, intros)

    def _process_of(self, line: ParsedLine) -> str:
        """The line's process; un-prefixed traceback lines join the traceback open before them."""
        if line.process is not None:
            return line.process
        last = self.states.get(self._last_process)
        if last is not None and last.phase != "none" and _continues_traceback(line.text):
            return self._last_process
        return _DEFAULT_PROCESS

    def _open(self, index: int | None, state: _State, process: str) -> None:
        """Start a new traceback block for `process`."""
        block = TracebackBlock(process=process, header=index, ignored=state.pending_ignored)
        block.chained_from = state.pending_chain
        state.pending_chain = None
        state.pending_ignored = False
        self.blocks.append(block)
        state.block = len(self.blocks) - 1
        state.phase = "frames"

    def _step(self, index: int, line: ParsedLine, state: _State, process: str) -> Role:
        """Advance `state` by one line and return the line's role."""
        text = line.text
        stripped = text.strip()
        if text.endswith(_TB_HEADER):
            intro = index if stripped != _TB_HEADER else state.message
            self._open(index, state, process)
            self.blocks[state.block].intro = intro
            return Role.HEADER
        if stripped in _CHAIN_MARKERS:
            state.pending_chain = state.block if state.block >= 0 else None
            state.phase = "none"
            return Role.CHAIN
        if stripped.startswith("Exception ignored in"):
            state.pending_ignored = True
            state.phase = "none"
            return Role.IGNORED
        if _FRAME.match(text):
            if state.phase != "frames":
                self._open(None, state, process)
            self.blocks[state.block].frames.append(index)
            return Role.FRAME
        if state.phase == "frames":
            return self._in_frames(index, line, state)
        if state.phase == "message":
            return self._in_message(index, line, state)
        if not stripped:
            return Role.BLANK
        if is_exception_line(text, in_traceback=False):
            # A logged exception whose traceback was not printed (or cut): a block of its own.
            self._open(None, state, process)
            return self._in_frames(index, line, state)
        return Role.MESSAGE

    def _in_frames(self, index: int, line: ParsedLine, state: _State) -> Role:
        """Inside a traceback's frames: code lines until the exception line."""
        text = line.text
        block = self.blocks[state.block]
        if not text.strip():
            return Role.BLANK
        if is_exception_line(text, in_traceback=True):
            block.exception = index
            state.phase = "message"
            state.exc_level = line.level
            return Role.EXCEPTION
        if block.frames and block.frames[-1] not in block.code:
            block.code[block.frames[-1]] = index
        return Role.CODE

    def _in_message(self, index: int, line: ParsedLine, state: _State) -> Role:
        """After the exception line: message continuation until a blank or another format."""
        block = self.blocks[state.block]
        text = line.text
        if not text.strip() or line.level != state.exc_level or len(block.details) >= _MAX_DETAILS:
            state.phase = "none"
            return Role.BLANK if not text.strip() else self._step(index, line, state, block.process)
        block.details.append(index)
        return Role.DETAIL


def annotate(lines: Sequence[LogLine]) -> Annotated:
    """Parse every line, de-interleave by process and reassemble the tracebacks."""
    return _Annotator(parse_lines(lines)).run()


# Crash forms that are not Python exception lines. Each names its own cause.
_PANIC = re.compile(
    r"^thread '(?P<thread>[^']*)' panicked at (?:'(?P<quoted>.*)', )?(?P<at>\S+:\d+:\d+):?$"
)
# argparse's `prog: error: ...`; clap (TGI's launcher) writes `error: ...` with no program.
_USAGE_ERROR = re.compile(
    r"^(?:[\w./-]+(?: [\w./-]+)?: )?error: (?:argument |unrecognized arguments|the following "
    r"(?:required )?arguments (?:are|were not) |invalid (?:choice|value)|ambiguous option|"
    r"expected one argument|unexpected argument|unknown)"
)
_CLICK_ERROR = re.compile(
    r"^Error: (?:No such option|No such command|Invalid value|Missing (?:argument|option)|Got "
    r"unexpected extra argument)"
)
_TERMINATE = "terminate called after throwing an instance of "
_WHAT = "what():"
_FATAL_PYTHON = "Fatal Python error: "
# A compiler's or linker's own error line (a JIT build at startup: triton, flashinfer, a torch
# extension): `x.c:5:10: fatal error: Python.h: ...`, `ld: cannot find -lcuda`, `nvcc fatal`.
_BUILD_ERROR = re.compile(
    r"^(?:\S+:\d+:\d+: fatal error: |(?:\S*/)?ld(?:\.\w+)?: cannot find -l|nvcc fatal\s*: )"
)
# A native assertion that aborted the process: glibc's `prog: x.c:12: f: Assertion `n > 0'
# failed.`, ggml's `x.cpp:2273: GGML_ASSERT(a <= b) failed`, glog's and absl's `Check failed: `.
# An AssertionError in all but name.
_NATIVE_ASSERT = re.compile(
    r"^(?:[^\s:]+: )?(?:\S+:\d+: )?(?:[^:\n]{1,200}: )?(?:Assertion `.+' failed\.?|"
    r"GGML_ASSERT\(.+\) failed|"
    r"Check failed: .+)$"
)
# libzmq's assertions (vLLM's and SGLang's ZMQ sockets), each a whole line before abort():
# zmq_assert's `Assertion failed: check () (src/msg.cpp:347)` and errno_assert's strerror alone,
# `Too many open files (src/epoll.cpp:38)`: a C or C++ source file's place closes the line.
_PLACED_ASSERT = re.compile(r"^.{0,200}?\S \((?:[\w.-]+/)*[\w.-]+\.(?:c|cc|cpp|cxx|hpp):\d+\)$")
# A Go program's panic (Ollama's server): `panic: runtime error: invalid memory address or nil
# pointer dereference`, then `[signal SIGSEGV: ...]` and each goroutine's stack.
_GO_PANIC = re.compile(r"^panic: \S")
_FOLLOWING_LINES = 3  # how far a panic's message or C++'s what() may be from its first line


def crash_form(ann: Annotated, index: int) -> str | None:
    """The cause text when the line at `index` starts a non-Python crash form, else None.

    A Rust panic (`thread 'main' panicked at src/main.rs:12:5:`, its message on the next line
    since Rust 1.73, in quotes before that), an argparse or click usage error, C++'s
    `terminate called after throwing an instance of 'X'` with its `what():` line, Python's
    faulthandler (`Fatal Python error: Segmentation fault`), a compiler's or linker's
    error line (`main.c:5:10: fatal error: Python.h: No such file or directory`), a native
    assertion (`llama-context.cpp:2273: GGML_ASSERT(n <= max) failed`), and a Go panic
    (`panic: runtime error: index out of range [3] with length 3`).
    """
    text = ann.lines[index].text.strip()
    if text.startswith("thread '") and (m := _PANIC.match(text)) is not None:
        message = m.group("quoted") or _next_text(ann, index) or ""
        return f"{message} (Rust panic in thread '{m.group('thread')}' at {m.group('at')})"
    if ("error: " in text and _USAGE_ERROR.match(text)) or (
        text.startswith("Error: ") and _CLICK_ERROR.match(text)
    ):
        return text
    if text.startswith(_TERMINATE):
        what = _next_text(ann, index, startswith=_WHAT)
        return f"{text}: {what}" if what else text
    if text.startswith(_FATAL_PYTHON) or _BUILD_ERROR.match(text) or is_native_assert(text):
        return text
    if text.startswith("panic: ") and _GO_PANIC.match(text):
        return text
    return None


def is_native_assert(text: str) -> bool:
    """A C or C++ assertion's failure line (`_NATIVE_ASSERT`, `_PLACED_ASSERT`)."""
    if text.endswith(")") and _PLACED_ASSERT.match(text) is not None:
        return True
    return "failed" in text and _NATIVE_ASSERT.match(text) is not None


_EXCEPTION_NAME = re.compile(r"((?:[A-Za-z_]\w*\.)*[A-Z]\w*)(?::|$)")
_THROWN = re.compile(r"instance of '(?:\w+::)*(\w+)'")
# `raise ValueError(f"...")` or `raise errors.X("...")`: a class being constructed, not a
# re-raise of a variable (`raise e`, `raise exc from None`).
_RAISE = re.compile(r"raise\s+((?:[A-Za-z_]\w*\.)*[A-Z]\w*)\s*\(")


def exception_name(text: str) -> str | None:
    """The class an exception line (or C++'s `terminate ... instance of 'X'`) names; a native
    assertion's failure is an AssertionError."""
    if is_native_assert(text):
        return "AssertionError"
    if text.startswith(_TERMINATE):
        m = _THROWN.search(text)
        return m.group(1) if m else None
    m = _EXCEPTION_NAME.match(text)
    return m.group(1).rsplit(".", 1)[-1] if m else None


def raise_statement(code: str) -> str | None:
    """The class a `raise X(...)` source line constructs, or None for any other line."""
    m = _RAISE.match(code.strip())
    return m.group(1).rsplit(".", 1)[-1] if m else None


def raise_without_message(code: str) -> bool:
    """A `raise X(` statement whose message is not on its line (`raise Exception(` continued
    below, `raise X()`): it names a class and no words."""
    text = code.strip()
    m = _RAISE.match(text)
    return m is not None and text[m.end() :].strip() in ("", ")")


def _next_text(ann: Annotated, index: int, *, startswith: str = "") -> str | None:
    """A following line of the same process (within a few lines), stripped."""
    process = ann.processes[index]
    for later in range(index + 1, min(len(ann.lines), index + 1 + _FOLLOWING_LINES)):
        if ann.processes[later] != process:
            continue
        text = ann.lines[later].text.strip()
        if text and text.startswith(startswith):
            return text
    return None


@dataclass(frozen=True, slots=True)
class Carried:
    """The cause a wrapper line carries inside it, and which wrapper that was."""

    wrapper: str
    cause: str  # an exception line (`ImportError: ...`), a message, or only a class name
    # The program caught the exception and went on: the line is a warning, whatever level
    # it was printed at (vLLM's `Failed to import from vllm._C with ...` at import).
    caught: bool = False


_EXC_NAME = r"(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception)"
# Wrappers that carry the cause in their own line, each with a `cause` group, and the class
# in `exc` when the wrapper names it apart from the message.
_CARRIERS = (
    # vLLM <= 0.6's worker processes: `logger.error("Exception in worker %s while processing
    # method %s: %s, %s", name, method, e, traceback)`, the traceback starting on this line.
    (
        "worker method {method}",
        re.compile(
            r"Exception in worker \S+ while processing method (?P<method>\w+): (?P<cause>.+?)"
            r"(?:, Traceback \(most recent call last\):)?$"
        ),
    ),
    # vLLM's `_custom_ops` and platform detection warn with the import's exception.
    (
        "import of {module}",
        re.compile(
            rf"Failed to import from (?P<module>[\w.]+)(?: with|:) (?P<exc>{_EXC_NAME})"
            r"\((?P<q>['\"])(?P<cause>.*)(?P=q)\)$"
        ),
    ),
    # vLLM V0 re-raises a model's error as `type(err)(f"Error in model execution (input
    # dumped to {path}): {err}")`: the class is the original's.
    (
        "model execution",
        re.compile(
            rf"(?P<exc>{_EXC_NAME}): Error in model execution(?: \([^)]*\))?: (?P<cause>.+)$"
        ),
    ),
    # vLLM V1's executor: `Worker failed with error '{e}', please check the stack trace above`.
    (
        "worker",
        re.compile(
            rf"(?:{_EXC_NAME}: )?Worker failed with error '(?P<cause>.*)', please check the "
            r"stack trace above"
        ),
    ),
    # Ray: `ray.exceptions.RayTaskError(ValueError): ray::Actor.method() (pid=..., ip=...)`;
    # the message is in the traceback that follows, the class is here.
    ("Ray task", re.compile(r"(?:ray\.exceptions\.)?RayTaskError\((?P<cause>\w+)\): ")),
)
_CAUGHT = frozenset({"import of {module}"})
_CARRIER_WORDS = (
    "Exception in worker",
    "Failed to import",
    "Error in model",
    "Worker failed",
    "RayTaskError",
)


def carried_cause(text: str) -> Carried | None:
    """The cause a wrapper carries inside `text` (a line without its prefixes), or None.

    `Exception in worker W while processing method M: <cause>, Traceback ...` (vLLM V0's
    workers), `Failed to import from M with ImportError('<cause>')`, `RuntimeError: Error in
    model execution (input dumped to P): <cause>`, `Worker failed with error '<cause>'` and
    `RayTaskError(ValueError): ...` (the class only)."""
    if not any(word in text for word in _CARRIER_WORDS):
        return None
    for name, pattern in _CARRIERS:
        m = pattern.match(text)
        if m is None:
            continue
        groups = m.groupdict()
        cause = groups["cause"]
        if groups.get("exc"):
            cause = f"{groups['exc']}: {cause}"
        return Carried(wrapper=name.format(**groups), cause=cause, caught=name in _CAUGHT)
    return None
