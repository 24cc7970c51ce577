"""The determinism lexicon: what a crash's words, class and raise site say about the next start.

The data is config/lexicon.toml (its header documents the entries); this module loads and
validates it, as `schema.py` does the signature table, and reads text with it:

- `words(text)`: the clues a cause's wording gives (deterministic or indeterminate), one per
  entry, up to where the text starts listing possibilities ("This can happen when (1) ...
  OOM"); a phrase inside a longer phrase of the other reading gives way to it ("exceeded" in
  "rate limit exceeded").
- `line_kind(text)`: what a line is before it is evidence: a pointer to a cause printed
  elsewhere (a wrapper), a report that the program coped (not a cause), a line whose words read
  either way, or nothing the lexicon knows.
- `capacity(text)`: what a memory check's own numbers say (asked for more than the device
  has at all, or only more than is free).
- `exception(name)`, `site(frame)`: what an exception class, and the innermost frame's module
  or function, say.

Patterns are RE2, as the signature table's are (linear time: no log line can stall the
daemon), and every wording pattern goes into one `re2.Set`, so a line is scanned once whatever
the lexicon's size; a pattern's own regex runs only when the set reports it. Every error names
the file, the entry and the field: `config/lexicon.toml: wording 'not_supported':
patterns[2]: invalid regex: ...`.
"""

from __future__ import annotations

import functools
import re
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from pathlib import Path
from typing import Any

import re2

from ..errors import ConfigError
from ..util.files import data_path
from .signatures import compile_pattern


class Reads(StrEnum):
    """Which way a clue points."""

    DETERMINISTIC = "deterministic"  # the same start meets it again
    INDETERMINATE = "indeterminate"  # the next start may not
    POINTER = "pointer"  # the line reports a failure printed elsewhere: a wrapper
    HANDLED = "handled"  # the program coped and went on: not a cause
    SPECULATION = "speculation"  # what follows lists possibilities: not evidence


class Strength(IntEnum):
    """How much one clue weighs against a clue of the other reading."""

    WEAK = 1
    STRONG = 2
    DECISIVE = 3


CAUSE_READINGS = (Reads.DETERMINISTIC, Reads.INDETERMINATE)


@dataclass(frozen=True, slots=True)
class Clue:
    """One piece of evidence: the entry, its reading and weight, and what it saw."""

    entry: str
    reads: Reads
    strength: Strength
    said: str  # the words matched, the class, or the frame's module or function
    kind: str  # "words" | "class" | "site"

    def describe(self) -> str:
        """For a severity_reason: `words 'is not supported' (not_supported)`."""
        return f"{self.kind} {self.said!r} ({self.entry})"


@dataclass(frozen=True, slots=True)
class _Wording:
    id: str
    reads: Reads
    strength: Strength
    patterns: tuple[Any, ...]  # compiled RE2 regexes


@dataclass(frozen=True, slots=True)
class _Exception:
    id: str
    reads: Reads
    strength: Strength
    names: frozenset[str]


@dataclass(frozen=True, slots=True)
class _Request:
    id: str
    names: frozenset[str]


@dataclass(frozen=True, slots=True)
class _Capacity:
    id: str
    pattern: Any  # compiled RE2, groups free, total, wanted, unit, wanted_unit


@dataclass(frozen=True, slots=True)
class _Site:
    id: str
    reads: Reads
    paths: tuple[Any, ...]  # compiled RE2 regexes
    functions: tuple[Any, ...]


_TABLES = ("wording", "exception", "capacity", "site", "request")
_KEYS: dict[str, dict[str, type]] = {
    "wording": {
        "id": str,
        "reads": str,
        "strength": str,
        "patterns": list,
        "why": str,
        "examples": list,
        "counter_examples": list,
    },
    "exception": {"id": str, "reads": str, "strength": str, "names": list, "why": str},
    "capacity": {"id": str, "pattern": str, "why": str, "examples": list},
    "request": {"id": str, "names": list, "why": str},
    "site": {
        "id": str,
        "reads": str,
        "paths": list,
        "functions": list,
        "why": str,
        "examples": list,
    },
}
_READS = {
    "wording": tuple(Reads),
    "exception": CAUSE_READINGS,
    "site": CAUSE_READINGS,
}
_CAPACITY_GROUPS = ("free", "total", "wanted")
_CAPACITY_NAMES = (*_CAPACITY_GROUPS, "unit", "wanted_unit")
_STRENGTHS = {s.name.lower(): s for s in Strength}
_ID = re.compile(r"[a-z][a-z0-9_]*\Z")
_NAME = re.compile(r"[A-Z]\w*\Z")
# `File "/x/y.py", line 3, in fn` (faulthandler writes no comma before `in`).
_FRAME = re.compile(r'\s*File "(?P<path>[^"]*)"(?:, line \d+)?(?:,? in (?P<function>\S+))?')


def frame_parts(frame: str) -> tuple[str, str | None] | None:
    """The file and function of a traceback frame line, or None when it is not one."""
    m = _FRAME.match(frame)
    return (m.group("path"), m.group("function")) if m else None


class Lexicon:
    """The validated lexicon, ready to read text."""

    def __init__(
        self,
        wording: Sequence[_Wording],
        exceptions: Sequence[_Exception],
        sites: Sequence[_Site],
        capacities: Sequence[_Capacity] = (),
        requests: Sequence[_Request] = (),
        *,
        source: str = "",
    ) -> None:
        self.source = source
        self._requests = frozenset(name for entry in requests for name in entry.names)
        self._wording = tuple(wording)
        self._exceptions = {name: entry for entry in exceptions for name in entry.names}
        self._sites = tuple(sites)
        self._capacities = tuple(capacities)
        # Every wording pattern in one RE2 set: set index -> (entry, its pattern).
        self._owners = [(entry, pattern) for entry in self._wording for pattern in entry.patterns]
        self._set = _wording_set([pattern for _, pattern in self._owners])
        # The words that name a deterministic cause outright, in a set of their own: asked of
        # every quiet line before serving (`names_a_shortfall`), one small match each.
        self._decisive = _wording_set(
            [
                pattern
                for entry in self._wording
                if entry.reads is Reads.DETERMINISTIC and entry.strength is Strength.DECISIVE
                for pattern in entry.patterns
            ]
        )

    def _hits(self, text: str) -> list[tuple[_Wording, Any]]:
        """The (entry, pattern) pairs whose pattern occurs in `text`, in the lexicon's order."""
        if self._set is None or not text:
            return []
        return [self._owners[i] for i in sorted(self._set.Match(text) or ())]

    def names_a_shortfall(self, text: str) -> bool:
        """Its words name a deterministic cause outright (a decisive deterministic wording:
        an allocator's budget below zero), whatever the level of the line."""
        return self._decisive is not None and bool(text) and bool(self._decisive.Match(text))

    def coped(self, text: str) -> bool:
        """The line says the program coped and went on (a retry, a fallback, `Ignore ...`),
        unless its words name a shortfall outright (`Use the profiled value instead` of a
        value below zero copes with nothing)."""
        return self.line_kind(text) is Reads.HANDLED and not self.names_a_shortfall(text)

    def line_kind(self, text: str) -> Reads | None:
        """A pointer or a handled report first (whatever else the line says), then a line
        whose words read either way, else None."""
        kinds = {entry.reads for entry, _ in self._hits(text)}
        for kind in (Reads.POINTER, Reads.HANDLED):
            if kind in kinds:
                return kind
        if not kinds & set(CAUSE_READINGS):
            return None
        clues = self.words(text)
        return clues[0].reads if clues else None

    def words(self, text: str) -> tuple[Clue, ...]:
        """The deterministic and indeterminate clues of `text`'s wording, one per entry; the
        words after a list of possibilities begins ("This can happen when ...") do not count."""
        hits = self._hits(text)
        speculation = [p for entry, p in hits if entry.reads is Reads.SPECULATION]
        if speculation:
            starts = [m.start() for p in speculation if (m := p.search(text)) is not None]
            text = text[: min(starts, default=len(text))]
            hits = self._hits(text)
        found: list[tuple[_Wording, Any]] = []
        for entry, pattern in hits:
            if entry.reads not in CAUSE_READINGS or any(e is entry for e, _ in found):
                continue
            if (m := pattern.search(text)) is not None:
                found.append((entry, m))
        kept = [
            (entry, m)
            for entry, m in found
            if not any(_inside(m, other) for e, other in found if e.reads is not entry.reads)
        ]
        return tuple(
            Clue(entry.id, entry.reads, entry.strength, m.group(0).strip(), "words")
            for entry, m in kept
        )

    def capacity(self, text: str) -> Clue | None:
        """What a memory check's numbers say: more wanted than the device has in all never
        fits; more than is free, but not than in all, means another process holds the rest."""
        for entry in self._capacities:
            m = entry.pattern.search(text)
            if m is None or m.group("unit") != m.group("wanted_unit"):
                continue  # numbers in two units say nothing to each other
            try:
                free, total, wanted = (float(m.group(g)) for g in _CAPACITY_GROUPS)
            except (TypeError, ValueError):  # TypeError: an optional group that took no part
                continue  # a pattern that caught words, not numbers: they say nothing
            unit = m.group("unit")
            if wanted > total:
                said = f"{wanted:g} {unit} wanted, {total:g} {unit} in all"
                return Clue(entry.id, Reads.DETERMINISTIC, Strength.DECISIVE, said, "numbers")
            if wanted > free:
                said = f"{wanted:g} of {total:g} {unit} wanted, {free:g} free"
                return Clue(entry.id, Reads.INDETERMINATE, Strength.DECISIVE, said, "numbers")
        return None

    def request_error(self, name: str | None) -> bool:
        """An exception class a request's own input raises (its [[request]] entries): raised
        while a request is handled, it ends that request, never the server."""
        return name is not None and name.rsplit(".", 1)[-1] in self._requests

    def exception(self, name: str | None) -> Clue | None:
        """What an exception class says, by its unqualified name."""
        if not name:
            return None
        short = name.rsplit(".", 1)[-1]
        entry = self._exceptions.get(short)
        if entry is None:
            return None
        return Clue(entry.id, entry.reads, entry.strength, short, "class")

    def site(self, frame: str | None, callers: Sequence[str] = ()) -> Clue | None:
        """What the innermost frame's module or function says (always a weak clue). A helper
        of the standard library with no site of its own (`subprocess.check_returncode`)
        raises for its caller: then the innermost caller outside that library says it."""
        clue = self._site_of(frame)
        if clue is not None or not _in_standard_library(frame):
            return clue
        for caller in reversed(callers):
            if not _in_standard_library(caller):
                return self._site_of(caller)
        return None

    def _site_of(self, frame: str | None) -> Clue | None:
        parts = frame_parts(frame) if frame else None
        if parts is None:
            return None
        path, function = parts
        standard_library = _STANDARD_LIBRARY.search(path) is not None
        for entry in self._sites:
            if any(p.search(path) for p in entry.paths):
                return Clue(entry.id, entry.reads, Strength.WEAK, _module(path), "raised in")
            if (
                function
                and not standard_library
                and any(p.search(function) for p in entry.functions)
            ):
                return Clue(entry.id, entry.reads, Strength.WEAK, function, "raised in")
        return None


# A module of Python's own library: `/usr/lib/python3.12/subprocess.py`, not site-packages.
_STANDARD_LIBRARY = re.compile(r"/lib/python3(?:\.\d+)?/(?!site-packages/|dist-packages/)")


def _in_standard_library(frame: str | None) -> bool:
    parts = frame_parts(frame) if frame else None
    return parts is not None and _STANDARD_LIBRARY.search(parts[0]) is not None


def _wording_set(patterns: Sequence[Any]) -> Any:
    """One RE2 set of the wording patterns (None for none)."""
    if not patterns:
        return None
    options = re2.Options()
    options.log_errors = False
    options.max_mem = max(8 << 20, len(patterns) * (64 << 10))
    rset = re2.Set.SearchSet(options)
    for pattern in patterns:
        rset.Add(pattern.pattern)
    rset.Compile()
    return rset


def _inside(m: Any, other: Any) -> bool:
    """`m`'s span lies within the longer `other`'s."""
    start, end = m.span()
    o_start, o_end = other.span()
    return bool(o_start <= start and end <= o_end and (o_end - o_start) > (end - start))


def _module(path: str) -> str:
    """`/x/site-packages/vllm/model_executor/layers/linear.py` -> `vllm/model_executor/layers/
    linear.py`: the path from the package on, as a person names the module."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[-1]
    return "/".join(path.rsplit("/", 3)[-3:])


# -- loading and validation ---------------------------------------------------------------------


DEFAULT_LEXICON_PATH: Path = data_path("lexicon.toml")


class _Where:
    """Builds error messages that point at one field of one entry."""

    def __init__(self, path: Path, table: str, entry_id: str | None) -> None:
        self.prefix = f"{path}: {table} '{entry_id}'" if entry_id else f"{path}: {table}"

    def error(self, field: str, message: str) -> ConfigError:
        return ConfigError(f"{self.prefix}: {field}: {message}")


def _check_keys(raw: dict[str, Any], table: str, where: _Where) -> None:
    keys = _KEYS[table]
    for key, value in raw.items():
        if key not in keys:
            raise where.error(key, f"unknown key (allowed: {', '.join(sorted(keys))})")
        if not isinstance(value, keys[key]):
            raise where.error(key, f"must be a {keys[key].__name__}, got {type(value).__name__}")
    for key in ("id", "why") if table in ("capacity", "request") else ("id", "reads", "why"):
        if key not in raw:
            raise where.error(key, "missing (required)")
    if not _ID.match(raw["id"]):
        raise where.error("id", "must be snake_case ([a-z][a-z0-9_]*)")


def _strings(raw: dict[str, Any], key: str, where: _Where) -> list[str]:
    values = raw.get(key, [])
    for index, value in enumerate(values):
        if not isinstance(value, str):
            raise where.error(f"{key}[{index}]", f"must be a str, got {type(value).__name__}")
    return list(values)


def _regexes(raw: dict[str, Any], key: str, where: _Where) -> tuple[Any, ...]:
    """RE2 regexes, as the signature table's: linear time on any line."""
    compiled = []
    for index, pattern in enumerate(_strings(raw, key, where)):
        try:
            compiled.append(compile_pattern(pattern))
        except ValueError as exc:
            raise where.error(f"{key}[{index}]", str(exc)) from exc
    return tuple(compiled)


def _reads(raw: dict[str, Any], table: str, where: _Where) -> Reads:
    allowed = _READS[table]
    if raw["reads"] not in [r.value for r in allowed]:
        names = ", ".join(r.value for r in allowed)
        raise where.error("reads", f"must be one of {names}, got {raw['reads']!r}")
    return Reads(raw["reads"])


def _strength(raw: dict[str, Any], where: _Where) -> Strength:
    value = raw.get("strength", "strong")
    if value not in _STRENGTHS:
        names = ", ".join(_STRENGTHS)
        raise where.error("strength", f"must be one of {names}, got {value!r}")
    return _STRENGTHS[value]


def _wording(raw: dict[str, Any], where: _Where) -> _Wording:
    patterns = _regexes(raw, "patterns", where)
    if not patterns:
        raise where.error("patterns", "must hold at least one regex")
    entry = _Wording(raw["id"], _reads(raw, "wording", where), _strength(raw, where), patterns)
    for index, example in enumerate(_strings(raw, "examples", where)):
        if not any(p.search(example) for p in patterns):
            raise where.error(f"examples[{index}]", f"not matched by its patterns: {example!r}")
    for index, example in enumerate(_strings(raw, "counter_examples", where)):
        if any(p.search(example) for p in patterns):
            raise where.error(f"counter_examples[{index}]", f"matched: {example!r}")
    return entry


def _class_names(raw: dict[str, Any], where: _Where) -> frozenset[str]:
    names = _strings(raw, "names", where)
    if not names:
        raise where.error("names", "must name at least one exception class")
    for index, name in enumerate(names):
        if not _NAME.match(name):
            raise where.error(f"names[{index}]", f"must be a class name, got {name!r}")
    return frozenset(names)


def _exception(raw: dict[str, Any], where: _Where) -> _Exception:
    names = _class_names(raw, where)
    reads = _reads(raw, "exception", where)
    return _Exception(raw["id"], reads, _strength(raw, where), names)


def _request(raw: dict[str, Any], where: _Where) -> _Request:
    return _Request(raw["id"], _class_names(raw, where))


def _capacity(raw: dict[str, Any], where: _Where) -> _Capacity:
    if "pattern" not in raw:
        raise where.error("pattern", "missing (required)")
    if not isinstance(raw["pattern"], str):
        raise where.error("pattern", "must be a str")
    try:
        pattern = compile_pattern(raw["pattern"])
    except ValueError as exc:
        raise where.error("pattern", str(exc)) from exc
    for group in _CAPACITY_NAMES:
        if group not in pattern.groupindex:
            raise where.error("pattern", f"needs a named group (?P<{group}>...)")
    entry = _Capacity(raw["id"], pattern)
    probe = Lexicon((), (), (), (entry,))
    for index, example in enumerate(_strings(raw, "examples", where)):
        if probe.capacity(example) is None:
            raise where.error(f"examples[{index}]", f"its numbers say nothing: {example!r}")
    return entry


def _site(raw: dict[str, Any], where: _Where) -> _Site:
    paths, functions = _regexes(raw, "paths", where), _regexes(raw, "functions", where)
    if not paths and not functions:
        raise where.error("paths", "a site needs paths or functions")
    entry = _Site(raw["id"], _reads(raw, "site", where), paths, functions)
    probe = Lexicon((), (), (entry,))
    for index, example in enumerate(_strings(raw, "examples", where)):
        clue = probe.site(example)
        if clue is None:
            raise where.error(f"examples[{index}]", f"not a frame this site reads: {example!r}")
    return entry


_BUILDERS: dict[str, Callable[[dict[str, Any], _Where], Any]] = {
    "wording": _wording,
    "exception": _exception,
    "capacity": _capacity,
    "site": _site,
    "request": _request,
}


def parse_lexicon(text: str, path: Path) -> Lexicon:
    """Validate the lexicon file's text; raise ConfigError naming file, entry and field."""
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError) as exc:  # the latter: nested too deeply
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    extra = sorted(set(data) - set(_TABLES))
    if extra:
        raise ConfigError(f"{path}: unknown top-level key(s) {extra}; only {list(_TABLES)}")
    built: dict[str, list[Any]] = {}
    seen: set[str] = set()
    for table in _TABLES:
        entries = data.get(table, [])
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ConfigError(f"{path}: '{table}' must be an array of tables [[{table}]]")
        built[table] = []
        for raw in entries:
            entry_id = raw.get("id") if isinstance(raw.get("id"), str) else None
            where = _Where(path, table, entry_id)
            _check_keys(raw, table, where)
            if raw["id"] in seen:
                raise where.error("id", "duplicate in this file")
            seen.add(raw["id"])
            built[table].append(_BUILDERS[table](raw, where))
    return Lexicon(
        built["wording"],
        built["exception"],
        built["site"],
        built["capacity"],
        built["request"],
        source=str(path),
    )


def load_lexicon(path: Path | None = None) -> Lexicon:
    """The lexicon at `path` (the shipped one by default), validated."""
    path = path or DEFAULT_LEXICON_PATH
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the lexicon: {exc}") from exc
    return parse_lexicon(text, path)


@functools.cache
def default_lexicon() -> Lexicon:
    """The shipped lexicon, loaded once per process."""
    return load_lexicon()


def strongest(clues: Iterable[Clue], reads: Reads) -> Strength | None:
    """The strongest clue of one reading, or None."""
    return max((c.strength for c in clues if c.reads is reads), default=None)
