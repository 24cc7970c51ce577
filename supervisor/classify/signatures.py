"""Load, validate, compile and match the crash signature table.

The table is data (`config/signatures/<domain>.toml`), so a new crash class is a reviewed TOML
entry with a test vector, not code. Every pattern is compiled with RE2, whose matching time is
linear in the line length: a hostile or pathological log line cannot stall the daemon. A line
is tried only against the patterns whose literal text it holds (`prefilter.py`: each pattern
indexed by a word every match contains), plus the few the prefilter cannot read, which share
RE2 sets; the individual regexes are compiled at their first use (each was parsed when the table
loaded, which validates it): a daemon's life needs a handful of the ~300. At load every pattern
still goes into `re2.Set`s of a bounded size once, so a table over RE2's memory budget is refused
then; a table read back from the cache (`table_cache.py`) passed that when it was saved, and
builds a signature only when a line needs it.

Ranking when several signatures match one line: noise first (a noise line is never a cause),
then causes, then generic wrappers; within a kind the higher `priority`, then the table order.
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple, overload

import re2

from ..errors import SignatureTableError
from ..model import Severity
from ..util.files import data_path
from . import table_cache
from .prefilter import Prefilter
from .schema import SignatureSpec, parse_table_bytes

ENV_SIGNATURE_DIR = "VLLM_SUPERVISOR_SIGNATURES"
DEFAULT_MAX_LINE_CHARS = 4096

_KIND_RANK = {"noise": 2, "cause": 1, "wrapper": 0}
# Patterns per RE2 set and the memory each is given (measured: 2,023 patterns need 32 MiB as
# one set, 10,693 need 64 MiB; 256 to a set scan a line in about the time one set does).
SET_PATTERNS = 256
SET_BYTES_PER_PATTERN = 64 << 10
RE2_DEFAULT_MAX_MEM = 8 << 20


def _default_signature_dir() -> Path:
    """The env override, the installed package's data dir, or the repository's config dir."""
    env = os.environ.get(ENV_SIGNATURE_DIR)
    return Path(env) if env else data_path("signatures")


DEFAULT_SIGNATURE_DIR: Path = _default_signature_dir()


@dataclass(frozen=True, slots=True, kw_only=True)
class Signature:
    """One crash class: how to recognise its line and what it means."""

    id: str
    title: str
    severity: Severity  # UNKNOWN for noise and for wrappers that name no severity
    remediation: str | None
    priority: int
    source: str | None
    kind: str  # cause | noise | wrapper
    domain: str  # the file stem: vllm, cuda, nccl, ...
    patterns: tuple[str, ...]
    frames: tuple[str, ...] = ()  # when set, a traceback frame must match one of these
    notes: str | None = None
    startup_severity: Severity | None = None  # before the server ever served, when it differs
    serving_severity: Severity | None = None  # after it served, when it differs
    packages: tuple[str, ...] = ()  # the distributions its crash is about (a halt's lift)
    order: int = 0  # position in the table, the last tie-breaker
    compiled: LazyRegexes = field(init=False, compare=False, repr=False)
    compiled_frames: LazyRegexes = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "compiled", LazyRegexes(self.patterns))
        object.__setattr__(self, "compiled_frames", LazyRegexes(self.frames))

    def render_remediation(self, captures: Mapping[str, str]) -> str | None:
        """The remediation with `{capture}` names filled in (`?` for one the line lacked)."""
        if self.remediation is None:
            return None
        return self.remediation.format_map(_Captures(captures))


class LazyRegexes:
    """A signature's patterns as RE2 regexes, each compiled when first asked for."""

    __slots__ = ("_patterns", "_regexes")

    def __init__(self, patterns: tuple[str, ...]) -> None:
        self._patterns = patterns
        self._regexes: list[Any] = [None] * len(patterns)

    def __len__(self) -> int:
        return len(self._patterns)

    @property
    def built(self) -> int:
        """How many are compiled so far."""
        return sum(regex is not None for regex in self._regexes)

    def __getitem__(self, index: int) -> Any:
        regex = self._regexes[index]
        if regex is None:
            regex = self._regexes[index] = compile_pattern(self._patterns[index])
        return regex

    def __iter__(self) -> Iterator[Any]:
        return (self[index] for index in range(len(self._patterns)))


class _Captures(dict[str, str]):
    """format_map helper: a capture the matching pattern did not define renders as `?`."""

    def __missing__(self, key: str) -> str:
        return "?"


@dataclass(frozen=True, slots=True)
class SignatureMatch:
    """The best signature for one line, with the named groups its pattern captured."""

    signature: Signature
    captures: Mapping[str, str]
    pattern_index: int


@dataclass(frozen=True, slots=True)
class MatchExplanation:
    """For `signatures test`: whether one signature matched a line, and why (not)."""

    signature: Signature
    matched: bool
    reason: str
    pattern_index: int | None = None
    captures: Mapping[str, str] = field(default_factory=dict)


def _options() -> Any:
    """RE2 options: UTF-8, no logging of bad patterns to stderr (we report them ourselves)."""
    options = re2.Options()
    options.log_errors = False
    return options


def _compile_set(
    signatures: Sequence[Signature],
    owners: Sequence[tuple[int, int]],
    files: Mapping[str, Path],
    patterns: Sequence[str] | None = None,
) -> Any:
    """One RE2 set of these patterns, its memory budget sized from their number.

    RE2's default budget (8 MiB) holds a few hundred patterns: a table of ~1,000 signatures
    failed to compile as one set and took the daemon down on a reload. Sets of at most
    SET_PATTERNS patterns, each with room for them, load any table; a set that still does not
    compile is a one-line table error naming its signatures' files. `patterns`, when given,
    are the owners' patterns (a cached table's signatures are then not built for them)."""
    options = _options()
    options.max_mem = max(RE2_DEFAULT_MAX_MEM, len(owners) * SET_BYTES_PER_PATTERN)
    rset = re2.Set.SearchSet(options)
    for number, (sig_index, pattern_index) in enumerate(owners):
        rset.Add(
            patterns[number]
            if patterns is not None
            else signatures[sig_index].patterns[pattern_index]
        )
    try:
        rset.Compile()
    except re2.error as exc:
        domains = sorted({signatures[sig_index].domain for sig_index, _ in owners})
        names = [str(files.get(domain, domain)) for domain in domains]
        ids = [signatures[owners[0][0]].id, signatures[owners[-1][0]].id]
        raise SignatureTableError(
            f"{', '.join(names)}: signatures {ids[0]} .. {ids[1]}: RE2 cannot compile "
            f"their {len(owners)} patterns within {options.max_mem >> 20} MiB: simplify them"
        ) from exc
    return rset


def _compile_sets(
    signatures: Sequence[Signature],
    owners: Sequence[tuple[int, int]],
    files: Mapping[str, Path],
    patterns: Sequence[str] | None = None,
) -> list[tuple[int, Any]]:
    """These patterns in sets of at most SET_PATTERNS, each with where it starts in `owners`."""
    return [
        (
            start,
            _compile_set(
                signatures,
                owners[start : start + SET_PATTERNS],
                files,
                None if patterns is None else patterns[start : start + SET_PATTERNS],
            ),
        )
        for start in range(0, len(owners), SET_PATTERNS)
    ]


def compile_pattern(pattern: str) -> Any:
    """Compile one RE2 regex; raise ValueError with RE2's reason when it is invalid."""
    try:
        return re2.compile(pattern, options=_options())
    except re2.error as exc:
        reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
        raise ValueError(f"invalid regex: {reason}") from exc


def check_pattern(pattern: str) -> None:
    """Validate one regex as the table's sets take it: parsed by RE2, not compiled (a tenth of
    the cost: a table of 5,000 signatures spent 0.6 s of its 1.6 s load compiling regexes it
    then threw away). ValueError with RE2's reason when it is invalid."""
    try:
        re2.Set.SearchSet(_CHECK_OPTIONS).Add(pattern)
    except re2.error:
        compile_pattern(pattern)  # raises with RE2's reason, which the set does not give
        raise ValueError("invalid regex") from None


_CHECK_OPTIONS = _options()


class _Layout(NamedTuple):
    """What matching needs of each signature without building it: id, domain, rank, and where
    its patterns start in the table's pattern numbers."""

    ids: tuple[str, ...]
    domains: tuple[str, ...]
    kinds: tuple[str, ...]
    priorities: tuple[int, ...]
    orders: Sequence[int]
    pattern_counts: tuple[int, ...]


class _CachedSignatures(Sequence[Signature]):
    """A cached table's signatures, each built from its spec at its first use."""

    __slots__ = ("_built", "_cached")

    def __init__(self, cached: table_cache.CachedTable) -> None:
        self._cached = cached
        self._built: list[Signature | None] = [None] * len(cached)

    def __len__(self) -> int:
        return len(self._built)

    @overload
    def __getitem__(self, index: int) -> Signature: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Signature, ...]: ...
    def __getitem__(self, index: int | slice) -> Signature | tuple[Signature, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(len(self))[index])
        position = range(len(self._built))[index]
        signature = self._built[position]
        if signature is None:
            signature = self._built[position] = _build(self._cached.spec(position), position)
        return signature

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]


class SignatureTable:
    """The compiled table: `match` one stripped line, `explain` it, or take a `subset`.

    A line is tried only against the patterns the prefilter (`prefilter.py`) says it may
    match; the patterns the prefilter cannot read share RE2 sets, compiled at the first line."""

    def __init__(
        self,
        signatures: Sequence[Signature],
        *,
        max_line_chars: int = DEFAULT_MAX_LINE_CHARS,
        files: Mapping[str, Path] | None = None,
    ) -> None:
        chosen = tuple(signatures)
        # Every pattern compiled into the sets RE2 would need for the whole table: a table over
        # RE2's memory budget is refused here, in one line, not at the first line that needs it.
        owners = [
            (i, j) for i, signature in enumerate(chosen) for j in range(len(signature.patterns))
        ]
        _compile_sets(chosen, owners, files or {})
        layout = _Layout(
            ids=tuple(s.id for s in chosen),
            domains=tuple(s.domain for s in chosen),
            kinds=tuple(s.kind for s in chosen),
            priorities=tuple(s.priority for s in chosen),
            orders=tuple(s.order for s in chosen),
            pattern_counts=tuple(len(s.patterns) for s in chosen),
        )
        prefilter = Prefilter.build([p for s in chosen for p in s.patterns])
        self._setup(chosen, layout, prefilter, max_line_chars, files)

    @classmethod
    def restored(
        cls,
        cached: table_cache.CachedTable,
        *,
        max_line_chars: int = DEFAULT_MAX_LINE_CHARS,
        files: Mapping[str, Path] | None = None,
    ) -> SignatureTable:
        """The table a cache holds: validated and its sets compiled when it was saved, so
        nothing is compiled now, and each signature is built when first needed."""
        table = cls.__new__(cls)
        layout = _Layout(
            ids=cached.ids,
            domains=cached.domains,
            kinds=cached.kinds,
            priorities=cached.priorities,
            orders=range(len(cached)),  # as load_signature_table numbers them
            pattern_counts=cached.pattern_counts,
        )
        table._setup(_CachedSignatures(cached), layout, cached.prefilter, max_line_chars, files)
        table.from_cache = True
        return table

    def _setup(
        self,
        signatures: Sequence[Signature],
        layout: _Layout,
        prefilter: Prefilter,
        max_line_chars: int,
        files: Mapping[str, Path] | None,
    ) -> None:
        self.signatures: Sequence[Signature] = signatures
        self.max_line_chars = max_line_chars
        self.prefilter = prefilter
        self._layout = layout
        self._files = files or {}
        # pattern number -> its signature: the signature whose first pattern number is the
        # greatest not above it
        self._starts = list(itertools.accumulate(layout.pattern_counts, initial=0))
        self._by_id: dict[str, int] | None = None  # built at the first `get`
        self._always: list[tuple[int, Any]] | None = None  # compiled at the first line
        self.from_cache = False  # read back validated from the cache (load_signature_table)

    def __len__(self) -> int:
        return len(self.signatures)

    @property
    def ids(self) -> tuple[str, ...]:
        """Every signature's id, in table order (without building the signatures)."""
        return self._layout.ids

    def get(self, signature_id: str) -> Signature | None:
        """The signature with this id, if the table holds it."""
        if self._by_id is None:
            self._by_id = {signature_id: i for i, signature_id in enumerate(self._layout.ids)}
        index = self._by_id.get(signature_id)
        return self.signatures[index] if index is not None else None

    @property
    def domains(self) -> frozenset[str]:
        """The domains (file stems) the table holds."""
        return frozenset(self._layout.domains)

    def _owner(self, number: int) -> tuple[int, int]:
        """(signature index, pattern index) of pattern `number`."""
        sig_index = bisect.bisect_right(self._starts, number) - 1
        return sig_index, number - self._starts[sig_index]

    def _rank(self, sig_index: int) -> tuple[int, int, int]:
        """Sort key, best first (as `_rank` of the signature, from the layout)."""
        layout = self._layout
        return (
            -_KIND_RANK[layout.kinds[sig_index]],
            -layout.priorities[sig_index],
            layout.orders[sig_index],
        )

    def _hits(self, text: str) -> list[tuple[int, int]]:
        """(signature, pattern) pairs whose pattern may match `text`, best first: those the
        prefilter keeps, and those of the patterns it cannot read that their sets find."""
        encoded = text.encode()  # once, for the prefilter and the sets (RE2 takes UTF-8)
        found = self.prefilter.candidates_in(encoded)
        always = self.prefilter.always
        if always:
            if self._always is None:
                owners = [self._owner(number) for number in always]
                self._always = _compile_sets(
                    self.signatures, owners, self._files, self.prefilter.always_patterns
                )
            for start, rset in self._always:
                matched = rset.Match(encoded)
                if matched:
                    found.update(always[start + i] for i in matched)
        if len(found) < 2:
            return [self._owner(i) for i in found]
        hits = sorted(self._owner(i) for i in found)
        hits.sort(key=lambda hit: self._rank(hit[0]))
        return hits

    def match(self, text: str, *, frames: Sequence[str] = ()) -> SignatureMatch | None:
        """The best signature for one stripped line; `frames` are its traceback's frame lines."""
        text = text[: self.max_line_chars]
        for sig_index, pattern_index in self._hits(text):
            signature = self.signatures[sig_index]
            m = signature.compiled[pattern_index].search(text)
            if m is None or not _frames_ok(signature, frames):
                continue
            return SignatureMatch(signature, _captures(m), pattern_index)
        return None

    def explain(self, text: str, *, frames: Sequence[str] = ()) -> list[MatchExplanation]:
        """Every signature with whether it matched `text` and why (not), best match first."""
        text = text[: self.max_line_chars]
        best = self.match(text, frames=frames)
        result = [self._explain_one(s, text, frames, best) for s in self.signatures]
        result.sort(key=lambda e: (not e.matched, _rank(e.signature)))
        return result

    def _explain_one(
        self, signature: Signature, text: str, frames: Sequence[str], best: SignatureMatch | None
    ) -> MatchExplanation:
        for index, regex in enumerate(signature.compiled):
            m = regex.search(text)
            if m is None:
                continue
            if not _frames_ok(signature, frames):
                return MatchExplanation(
                    signature, False, f"patterns[{index}] matched but no traceback frame matches"
                )
            if best is not None and best.signature.id != signature.id:
                reason = f"patterns[{index}] matched; outranked by '{best.signature.id}'"
                return MatchExplanation(signature, False, reason, index, _captures(m))
            return MatchExplanation(
                signature, True, f"patterns[{index}] matched", index, _captures(m)
            )
        return MatchExplanation(signature, False, "no pattern matched")

    def subset(self, domains: Collection[str]) -> SignatureTable:
        """A table with only the signatures of `domains` (per-unit signature sets)."""
        unknown = sorted(set(domains) - self.domains)
        if unknown:
            known = ", ".join(sorted(self.domains))
            raise SignatureTableError(f"unknown signature domain(s) {unknown}; known: {known}")
        chosen = [s for s in self.signatures if s.domain in domains]
        return SignatureTable(chosen, max_line_chars=self.max_line_chars)


def _rank(signature: Signature) -> tuple[int, int, int]:
    """Sort key, best first: noise, then cause, then wrapper; higher priority; table order."""
    return (-_KIND_RANK[signature.kind], -signature.priority, signature.order)


def _frames_ok(signature: Signature, frames: Sequence[str]) -> bool:
    """True when the signature needs no frame, or one of `frames` matches its frame patterns."""
    if not signature.compiled_frames:
        return True
    return any(rx.search(f) is not None for rx in signature.compiled_frames for f in frames)


def _captures(m: Any) -> Mapping[str, str]:
    """The named groups that took part in the match."""
    return MappingProxyType({k: v for k, v in m.groupdict().items() if v is not None})


def _build(spec: SignatureSpec, order: int) -> Signature:
    """A Signature from a validated spec (its patterns compile at first use)."""
    return Signature(
        id=spec.id,
        title=spec.title,
        severity=spec.severity,
        remediation=spec.remediation,
        priority=spec.priority,
        source=spec.source,
        kind=spec.kind,
        domain=spec.domain,
        patterns=spec.patterns,
        frames=spec.frames,
        notes=spec.notes,
        startup_severity=spec.startup_severity,
        serving_severity=spec.serving_severity,
        packages=spec.packages,
        order=order,
    )


def _table_files(paths: Sequence[Path] | None) -> list[Path]:
    """The TOML files to load: directories expand to their sorted `*.toml`."""
    files: list[Path] = []
    for path in [DEFAULT_SIGNATURE_DIR] if paths is None else paths:
        if path.is_dir():
            files.extend(sorted(path.glob("*.toml")))
        elif path.is_file():
            files.append(path)
        else:
            raise SignatureTableError(f"{path}: no such signature file or directory")
    if not files:
        raise SignatureTableError(f"no signature files found in {', '.join(map(str, paths or []))}")
    return files


def load_signature_table(
    paths: Sequence[Path] | None = None,
    *,
    max_line_chars: int = DEFAULT_MAX_LINE_CHARS,
    cache_dir: Path | None = None,
) -> SignatureTable:
    """Load and validate every signature file; `None` loads the shipped default directory.

    With `cache_dir`, files seen before (the same paths and bytes) are read back validated
    from there instead of parsed (`table_cache`); `SignatureTable.from_cache` says which."""
    files = []
    for path in _table_files(paths):
        try:
            files.append((path, path.read_bytes()))
        except OSError as exc:
            raise SignatureTableError(f"{path}: cannot read: {exc}") from exc
    key = table_cache.cache_key(files) if cache_dir is not None else ""
    names = {path.stem: path for path, _ in files}  # a set that fails names its files
    cached = table_cache.load_table(cache_dir, key, files) if cache_dir is not None else None
    if cached is not None:
        return SignatureTable.restored(cached, max_line_chars=max_line_chars, files=names)
    specs = _parse(files)
    table = SignatureTable(
        [_build(spec, i) for i, spec in enumerate(specs)],
        max_line_chars=max_line_chars,
        files=names,
    )
    if cache_dir is not None:
        table_cache.save(cache_dir, key, specs, files, table.prefilter)  # once its sets compiled
    return table


def _parse(files: Sequence[tuple[Path, bytes]]) -> list[SignatureSpec]:
    """Every file's validated specs, in order; ids unique across the files."""
    specs: list[SignatureSpec] = []
    seen: dict[str, Path] = {}
    for path, content in files:
        for spec in parse_table_bytes(path, content, check_pattern):
            if (unmatched := spec.unmatched_example(compile_pattern)) is not None:
                raise SignatureTableError(f"{path}: signature '{spec.id}': {unmatched}")
            if spec.id in seen:
                raise SignatureTableError(
                    f"{path}: signature '{spec.id}': id: duplicate, already defined in "
                    f"{seen[spec.id]}"
                )
            seen[spec.id] = path
            specs.append(spec)
    return specs
