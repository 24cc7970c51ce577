"""Which signature patterns a line could match, from literal text every match must contain.

A table of 5,000 signatures holds ~10,700 patterns; compiling them all into RE2 sets took ~0.2 s
of each load (pyre2 holds the GIL while compiling) and the first crash built those sets' automata.
Most patterns need some literal text (`CUDA out of memory`): this module reads, from each
pattern's RE2 syntax, literal runs that any match must contain (`required`), and indexes the
pattern by one word of them (`Prefilter`). A line is looked up by its own words: only patterns
whose word it holds, and whose literals it all contains, are candidates, and only those are
compiled and searched. Patterns it cannot read (an alternation of unknowns, `\\Q`, `\\x{..}`, a
construct it does not know) go to the `always` list, matched for every line as before.

The filter must never drop a pattern that matches, so every rule errs towards "keep":
- Text is compared as UTF-8 with ASCII letters lowered (`bytes.lower`), on both sides. A
  case-insensitive pattern's literal keeps only characters whose RE2 case orbit is their ASCII
  upper and lower case: RE2 folds `k` with the Kelvin sign and `s` with the long s, so those
  (and any other letter beyond ASCII under `(?i)`) end a literal run instead.
- A word is an ASCII `[a-z0-9_]` run, as RE2's `\\b` and `\\w` see it. A pattern is keyed by a
  whole word of its literal only when the literal (or a `\\b`, `^`, `$`, `\\s`, `\\W` next to it)
  bounds it on both sides: a line that holds the literal then holds that word as a word. A
  pattern with no such word (`cudaErrorNoDevice`) joins the `always` ones.
- Anything optional (`?`, `*`, `{0,n}`), repeated, a class, `.`, or a group holding `|` ends a
  run; a group required once is read through.
"""

from __future__ import annotations

import marshal
import re
from collections.abc import Sequence
from typing import cast

Key = bytes  # a whole word, lowered UTF-8
Branch = tuple[tuple[bytes, tuple[Key, ...]], ...]  # literals every match holds, each's keys
Filter = tuple[Branch, ...]  # a match satisfies one branch (the pattern's top-level `|`)

_WORD = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
# bytes -> the line's words: every byte that is not a word byte becomes a space.
_SPLIT = bytes(b if b in _WORD else 0x20 for b in range(256)).lower()
_CONTROL = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a"}
_PLAIN = re.compile(r"[^\\\[().*+?^$|{]+")  # characters that stand for themselves
# Under (?i): what may not join a literal (RE2 folds k and s with non-ASCII letters too).
_FOLDS_BEYOND_ASCII = re.compile(r"[^\x00-\x7f]|[kKsS]")
_REPEAT = re.compile(r"\{(\d+)(,(\d*))?\}")
_QUANTIFIER = re.compile(r"[*+?]|\{\d+(,\d*)?\}")
_POSIX_CLASS = re.compile(r"\[:\^?[a-z]+:\]")
_GROUP = re.compile(r"\?(?:P?<\w+>|([imsU]*)(?:-([imsU]*))?([:)]))")


class _Unreadable(Exception):
    """A construct this reader does not know: the pattern is matched for every line."""


# Items of a parsed sequence: literal text (a str), or one of these: a zero-width word edge,
# something not literal, or something not literal that surely consumes non-word characters.
BOUNDARY, GAP, NONWORD = 1, 2, 3
_Item = str | int


def _literal(text: str, icase: bool) -> list[_Item]:
    """Literal text as items; under (?i) a character RE2 may fold beyond ASCII is a gap."""
    if not icase:
        return [text] if text else []
    items: list[_Item] = []
    for number, part in enumerate(_FOLDS_BEYOND_ASCII.split(text)):
        if number:
            items.append(GAP)  # where the character that may not join was
        if part:
            items.append(part)
    return items


class _Reader:
    """A recursive-descent reader of RE2's syntax, down to what literals need."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.pos = 0

    def alternatives(self, icase: bool) -> list[list[_Item]]:
        """The branches of the sequence at `pos`, up to its closing `)` or the end."""
        branches: list[list[_Item]] = [[]]
        p = self.pattern
        while self.pos < len(p):
            c = p[self.pos]
            if c == ")":
                break
            if c == "|":
                self.pos += 1
                branches.append([])
            else:
                icase = self._item(branches[-1], icase)
        return branches

    def _item(self, items: list[_Item], icase: bool) -> bool:
        """Read one atom (and its repetition) into `items`; the case flag after it."""
        p, c = self.pattern, self.pattern[self.pos]
        if (m := _PLAIN.match(p, self.pos)) is not None:
            text, self.pos = m.group(), m.end()
            if _QUANTIFIER.match(p, self.pos) is None:
                items.extend(_literal(text, icase))
                return icase
            items.extend(_literal(text[:-1], icase))  # the repetition takes the last one
            atom = _literal(text[-1], icase)
        else:
            self.pos += 1
            if c == "\\":
                atom = self._escape(icase)
            elif c == "[":
                self._skip_class()
                atom = [GAP]
            elif c == "(":
                group, icase = self._group(icase)
                if group is None:
                    return icase  # a flag group: `(?i)` applies to the rest of this group
                atom = group
            elif c == ".":
                atom = [GAP]
            elif c in "^$":
                atom = [BOUNDARY]
            elif c == "{" and _REPEAT.match(p, self.pos - 1) is None:
                atom = _literal(c, icase)
            else:
                raise _Unreadable("a repetition of nothing")
        items.extend(self._repeated(atom))
        return icase

    def _repeated(self, atom: list[_Item]) -> list[_Item]:
        """`atom`, or what is left of it when a repetition operator follows."""
        p = self.pattern
        m = _QUANTIFIER.match(p, self.pos)
        if m is None:
            return atom
        self.pos = m.end()
        least = (
            1
            if m.group() == "+"
            else 0
            if m.group() in "*?"
            else int(m.group()[1:-1].split(",")[0])
        )
        if self.pos < len(p) and p[self.pos] == "?":
            self.pos += 1  # non-greedy
        if _QUANTIFIER.match(p, self.pos) is not None:
            raise _Unreadable("a repeated repetition")
        if BOUNDARY in atom or not atom:
            raise _Unreadable("a repeated assertion")
        if least == 0:
            return [GAP]
        if len(atom) == 1 and isinstance(atom[0], str) and len(atom[0]) == 1:
            return [atom[0], GAP]  # one of it, then maybe more
        return [NONWORD if all(item == NONWORD for item in atom) else GAP]

    def _escape(self, icase: bool) -> list[_Item]:
        if self.pos >= len(self.pattern):
            raise _Unreadable("a trailing backslash")
        c = self.pattern[self.pos]
        self.pos += 1
        if c in "bAz":
            return [BOUNDARY]
        if c == "B":
            return []
        if c in "sW":
            return [NONWORD]
        if c in "dwSD":
            return [GAP]
        if c in _CONTROL:
            return [_CONTROL[c]]
        if c.isascii() and not c.isalnum():
            return _literal(c, icase)
        raise _Unreadable(f"the escape \\{c}")

    def _skip_class(self) -> None:
        """Past a `[...]` class (RE2's rules: a leading `]` is literal, `[:name:]` inside)."""
        p, i = self.pattern, self.pos
        if i < len(p) and p[i] == "^":
            i += 1
        if i < len(p) and p[i] == "]":
            i += 1
        while i < len(p):
            if p[i] == "]":
                self.pos = i + 1
                return
            if p[i] == "\\" and p.startswith(("x{", "p{", "P{"), i + 1):
                i = p.find("}", i)
                if i < 0:
                    break
                i += 1
            elif p[i] == "\\":
                i += 2
            elif p.startswith("[:", i):
                m = _POSIX_CLASS.match(p, i)
                if m is None:
                    break
                i = m.end()
            else:
                i += 1
        raise _Unreadable("a class this reader does not follow")

    def _group(self, icase: bool) -> tuple[list[_Item] | None, bool]:
        """A group's items (a gap when it holds `|`), or None and the new flags for `(?flags)`."""
        p = self.pattern
        inner = icase
        if p.startswith("?", self.pos):
            m = _GROUP.match(p, self.pos)
            if m is None:
                raise _Unreadable("a group of unknown kind")
            self.pos = m.end()
            if m.group(3) is not None:  # flags
                if "i" in (m.group(1) or ""):
                    inner = True
                if "i" in (m.group(2) or ""):
                    inner = False
                if m.group(3) == ")":
                    return None, inner
        branches = self.alternatives(inner)
        if self.pos >= len(p) or p[self.pos] != ")":
            raise _Unreadable("an unclosed group")
        self.pos += 1
        if len(branches) > 1:
            return [GAP], icase
        return branches[0], icase


def required(pattern: str) -> Filter | None:
    """What any match of `pattern` must contain (one branch per top-level `|`), or None when
    this reader cannot tell (the pattern is then tried on every line)."""
    reader = _Reader(pattern)
    try:
        branches = reader.alternatives(icase=False)
        if reader.pos != len(pattern):
            raise _Unreadable("an unmatched )")
    except _Unreadable:
        return None
    result = []
    for items in branches:
        literals: dict[bytes, list[Key]] = {}
        for literal, left, right in _literal_runs(items):
            literals.setdefault(literal, []).extend(_keys(literal, left, right))
        if not any(literals.values()):
            return None  # a branch nothing keys would need every line
        result.append(tuple((literal, tuple(keys)) for literal, keys in literals.items()))
    return tuple(result)


def _literal_runs(items: Sequence[_Item]) -> list[tuple[bytes, bool, bool]]:
    """The literal runs of a sequence: (lowered UTF-8, bounded left, bounded right), where
    bounded means a word edge is sure there (an assertion, or non-word characters consumed)."""
    runs: list[tuple[bytes, bool, bool]] = []
    text: list[str] = []
    left = False  # is the place before the current run a sure word edge?
    for item in items:
        if isinstance(item, str):
            text.append(item)
            continue
        edge = item in (BOUNDARY, NONWORD)
        if text:
            runs.append(("".join(text).encode().lower(), left, edge))
            text = []
        left = edge
    if text:
        runs.append(("".join(text).encode().lower(), left, False))
    return runs


def _keys(literal: bytes, bounded_left: bool, bounded_right: bool) -> list[Key]:
    """The words of `literal` a line holding it holds as whole words too: those the literal
    (or a sure word edge beside it) bounds on both sides."""
    keys: list[Key] = []
    for m in re.finditer(rb"[a-z0-9_]+", literal):
        if (m.start() > 0 or bounded_left) and (m.end() < len(literal) or bounded_right):
            keys.append(m.group())
    return keys


def _poor(word: bytes) -> bool:
    """A word too common in log lines to key by (a number, a short word): many lines hold it."""
    return len(word) < 3 or word.isdigit()


Entries = tuple[tuple[int, tuple[bytes, ...]], ...]  # (pattern number, its other literals)
Bucket = tuple[tuple[bytes, Entries], ...]  # the literal holding the key, the patterns it opens


class Prefilter:
    """Patterns indexed by one key of each branch; `candidates` of a line, `always` the rest.

    A bucket groups its patterns by the literal the key came from, tried once for them all
    (near copies of one pattern share it). A bucket read back from the table cache stays
    marshalled until a line's word asks for it: a table of 10,000 patterns loads its index
    without building their literals."""

    __slots__ = ("_index", "_keys", "always", "always_patterns")

    def __init__(
        self,
        index: dict[bytes, Bucket | bytes],
        always: tuple[int, ...],
        always_patterns: tuple[str, ...],
    ) -> None:
        self._index = index  # word -> bucket (or its marshal bytes)
        self._keys = frozenset(index)
        self.always = always  # pattern numbers no key covers, in order
        self.always_patterns = always_patterns  # and their patterns

    @classmethod
    def build(cls, patterns: Sequence[str]) -> Prefilter:
        """Index pattern `n` (of `patterns[n]`) by the rarest key of each of its branches."""
        filters = [required(pattern) for pattern in patterns]
        counts: dict[Key, int] = {}
        for found in filters:
            for branch in found or ():
                for key in {key for _, keys in branch for key in keys}:
                    counts[key] = counts.get(key, 0) + 1
        index: dict[bytes, dict[bytes, list[tuple[int, tuple[bytes, ...]]]]] = {}
        always = []
        for number, found in enumerate(filters):
            if found is None:
                always.append(number)
                continue
            for branch in found:
                word, literal = min(
                    ((key, literal) for literal, keys in branch for key in keys),
                    key=lambda pair: (_poor(pair[0]), counts[pair[0]], -len(pair[0])),
                )
                others = tuple(other for other, _ in branch if other != literal)
                index.setdefault(word, {}).setdefault(literal, []).append((number, others))
        buckets: dict[bytes, Bucket | bytes] = {
            word: tuple((literal, tuple(entries)) for literal, entries in groups.items())
            for word, groups in index.items()
        }
        return cls(buckets, tuple(always), tuple(patterns[number] for number in always))

    def candidates(self, text: str) -> set[int]:
        """Pattern numbers whose literals `text` holds (all of one branch's), `always` aside."""
        # Strict: a lone surrogate raises here as it does in RE2's own encoding of the line.
        return self.candidates_in(text.encode())

    def candidates_in(self, encoded: bytes) -> set[int]:
        """`candidates` of a line already encoded as UTF-8."""
        # _SPLIT lower-cases as it splits: the line itself is lowered only when a key is in it.
        keys = self._keys.intersection(encoded.translate(_SPLIT).split())
        found: set[int] = set()
        if not keys:
            return found  # most lines
        data = encoded.lower()
        for key in keys:
            bucket = self._index[key]
            if isinstance(bucket, bytes):
                bucket = self._index[key] = marshal.loads(bucket)  # noqa: S302 - checked cache
            for literal, entries in bucket:
                if literal in data:
                    for number, others in entries:
                        if all(other in data for other in others):
                            found.add(number)
        return found

    def dump(self) -> tuple[dict[bytes, bytes], tuple[int, ...], tuple[str, ...]]:
        """The index as marshal takes it, each bucket marshalled apart (see the class)."""
        return (
            {
                key: bucket if isinstance(bucket, bytes) else marshal.dumps(bucket)
                for key, bucket in self._index.items()
            },
            self.always,
            self.always_patterns,
        )

    @classmethod
    def undump(
        cls, values: tuple[dict[bytes, bytes], tuple[int, ...], tuple[str, ...]]
    ) -> Prefilter:
        """The inverse of `dump`."""
        index, always, patterns = values
        if not isinstance(index, dict) or len(always) != len(patterns):
            raise ValueError("not a prefilter index")
        return cls(cast("dict[bytes, Bucket | bytes]", index), tuple(always), tuple(patterns))
