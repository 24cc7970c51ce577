"""The literal prefilter (`classify/prefilter.py`) never drops a pattern that matches a line,
and a table matching through it finds exactly what matching every pattern finds.

The reference here is the table as it matched before the prefilter: every pattern tried on the
line (there, through RE2 sets), the hits ranked, the first whose regex and frames hold wins.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import re2
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from vllm_supervisor.classify.prefilter import Prefilter, required
from vllm_supervisor.classify.signatures import (
    Signature,
    SignatureMatch,
    SignatureTable,
    load_signature_table,
)
from vllm_supervisor.model import Severity

VECTORS_FILE = Path(__file__).parent / "data" / "signature_vectors.toml"
VECTOR_LINES: list[str] = [
    vector["line"] for vector in tomllib.loads(VECTORS_FILE.read_text(encoding="utf-8"))["vector"]
]

# Letters RE2 folds beyond ASCII (k: the Kelvin sign, s: the long s), letters that fold to
# several, word and non-word bytes, RE2's specials.
ALPHABET = "abcksxyzABKSXZ019_ .:-/'\"()[]{}*+?|\\^$#,=<>\n\téÉßẞſKİıΣσς日"
VARIANTS = {"k": "kKK", "K": "kKK", "s": "sSſ", "S": "sSſ", "ß": "ßẞ", "ẞ": "ßẞ", "σ": "σΣς"}
SPECIAL = set("\\[](){}*+?|^$.")


WORDS = ["cuda", "error", "Kernel", "SIGSEGV", "out of memory", "nccl_", "rank 3", "Straße",
         "status", "σφάλμα", "x86_64", "OOM", "disk"]  # fmt: skip


@st.composite
def literal(draw: st.DrawFn) -> tuple[str, str]:
    """A literal character or word, and a text RE2 may match it with (another case, or a
    character RE2 folds with it)."""
    if draw(st.booleans()):
        chars = draw(st.sampled_from(WORDS))
        pattern = "".join(c if c not in SPECIAL else "\\" + c for c in chars)
        text = "".join(draw(st.sampled_from(VARIANTS.get(c, c + c.swapcase()))) for c in chars)
        return pattern, text
    c = draw(st.sampled_from(ALPHABET))
    text = draw(st.sampled_from(VARIANTS.get(c, c + c.swapcase())))
    if c == "\n":
        return "\\n", text
    if c in SPECIAL:
        return "\\" + c, c
    return c, text


# Escapes and classes RE2 takes; the last ones the prefilter does not read (the pattern is then
# tried on every line), drawn less often.
ESCAPES = [("\\d", "7"), ("\\w", "q"), ("\\s", " "), ("\\W", "-"), ("\\S", "x"), ("\\D", "y"),
           ("\\b", ""), ("\\B", ""), (".", "z"), ("^", ""), ("$", ""), ("\\A", ""), ("\\z", ""),
           ("[a-z]", "q"), ("[^x]", "y"), ("[]a]", "]"), ("[^]a]", "b"), ("[[:alpha:]]", "K"),
           ("[\\d.]", "."), ("[\\]x]", "]"), ("[k]", "K"), ("{", "{"), ("{,3}", "{,3}"),
           ("}", "}"), ("]", "]"), ("[\\x{41}-\\x{5a}]", "Q")]  # fmt: skip
UNREAD = [("\\x41", "A"), ("\\pL", "é"), ("\\Qa.b\\E", "a.b"), ("\\x{6b}", "k")]
QUANTIFIERS = [("*", [0, 1, 2]), ("+", [1, 2]), ("?", [0, 1]), ("{2}", [2]), ("{0,3}", [0, 2]),
               ("{1,}", [1, 3]), ("{2,3}", [2, 3])]  # fmt: skip
OPENERS = ["(?:", "(", "(?P<g>", "(?i:", "(?-i:", "(?i)(?:", "(?s:", "(?U:"]


def sequence(depth: int) -> st.SearchStrategy[tuple[str, str]]:
    atom: st.SearchStrategy[tuple[str, str]] = st.one_of(
        literal(), literal(), st.sampled_from(ESCAPES), st.sampled_from(ESCAPES + UNREAD)
    )
    if depth < 2:
        atom = st.one_of(atom, atom, group(depth + 1))
    return st.lists(repeated(atom), min_size=0, max_size=6).map(
        lambda parts: ("".join(p for p, _ in parts), "".join(t for _, t in parts))
    )


@st.composite
def repeated(draw: st.DrawFn, atom: st.SearchStrategy[tuple[str, str]]) -> tuple[str, str]:
    pattern, text = draw(atom)
    if draw(st.integers(0, 3)) > 0:
        return pattern, text
    operator, counts = draw(st.sampled_from(QUANTIFIERS))
    lazy = "?" if draw(st.booleans()) else ""
    return f"{pattern}{operator}{lazy}", text * draw(st.sampled_from(counts))


@st.composite
def group(draw: st.DrawFn, depth: int) -> tuple[str, str]:
    branches = draw(st.lists(sequence(depth), min_size=1, max_size=3))
    chosen = draw(st.sampled_from(branches))[1]
    opener = draw(st.sampled_from(OPENERS))
    name_fix = opener.replace("<g>", f"<g{draw(st.integers(0, 10**6))}>")
    return name_fix + "|".join(p for p, _ in branches) + ")", chosen


@st.composite
def pattern_and_line(draw: st.DrawFn) -> tuple[str, str]:
    flag = draw(st.sampled_from(["", "", "(?i)", "(?m)", "(?is)"]))
    branches = draw(st.lists(sequence(0), min_size=1, max_size=2))
    pattern = flag + "|".join(p for p, _ in branches)
    if draw(st.booleans()):  # a flag switched on part-way
        pattern += "(?i)" + draw(sequence(1))[0]
    text = draw(st.sampled_from(branches))[1]
    noise = st.text(alphabet=ALPHABET, max_size=8)
    return pattern, draw(noise) + text + draw(noise)


SEPARATORS = [(" ", " "), (": ", ": "), ("\\s+", "  "), ("\\b", ""), ("\\W", "-"), ("\\.", "."),
              ("[ :]", ":"), ("\\b\\s*", " "), ("", "")]  # fmt: skip


@st.composite
def keyed_pattern_and_line(draw: st.DrawFn) -> tuple[str, str]:
    """Words between separators, some optional or in alternations, under flags: patterns the
    prefilter keys (mostly), and a line holding a match among noise."""
    parts = []
    for _ in range(draw(st.integers(1, 5))):
        pattern, text = draw(literal())
        kind = draw(st.integers(0, 5))
        if kind == 0:
            other, other_text = draw(literal())
            pattern, text = f"(?:{pattern}|{other})", draw(st.sampled_from([text, other_text]))
        elif kind == 1:
            pattern, text = f"(?:{pattern})?", draw(st.sampled_from([text, ""]))
        elif kind == 2:
            flag = draw(st.sampled_from(["(?i:", "(?-i:", "(?P<n1>", "("]))
            pattern = f"{flag}{pattern})"
        separator, gap = draw(st.sampled_from(SEPARATORS))
        parts.append((pattern + separator, text + gap))
    flag = draw(st.sampled_from(["", "(?i)", "^", "(?i)\\b"]))
    pattern = flag + "".join(p for p, _ in parts)
    noise = st.text(alphabet=ALPHABET, max_size=6)
    return pattern, draw(noise) + "".join(t for _, t in parts) + draw(noise)


def _compiles(pattern: str) -> Any | None:
    options = re2.Options()
    options.log_errors = False
    try:
        return re2.compile(pattern, options=options)
    except re2.error:
        return None


def _keeps(pattern: str, line: str) -> bool:
    """Whether a table of this one pattern would try it on `line`."""
    prefilter = Prefilter.build([pattern])
    return bool(prefilter.always) or 0 in prefilter.candidates(line)


class TestNeverDropsAMatch:
    @given(pattern_and_line())
    @settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def test_a_pattern_that_matches_is_a_candidate(self, case: tuple[str, str]) -> None:
        """Generated RE2 patterns (case-insensitive parts, alternations, optional groups,
        escapes, classes, unicode): whenever RE2 finds one in a line, the prefilter keeps it."""
        pattern, line = case
        regex = _compiles(pattern)
        assume(regex is not None)
        if regex.search(line) is not None:
            assert _keeps(pattern, line), (pattern, line, required(pattern))

    @given(keyed_pattern_and_line())
    @settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def test_a_keyed_pattern_that_matches_is_a_candidate(self, case: tuple[str, str]) -> None:
        """The same on patterns made of words, most of which the prefilter keys by a word."""
        pattern, line = case
        regex = _compiles(pattern)
        assume(regex is not None)
        if regex.search(line) is not None:
            assert _keeps(pattern, line), (pattern, line, required(pattern))

    @given(pattern_and_line(), st.text(alphabet=ALPHABET, max_size=30))
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def test_any_line_at_all(self, case: tuple[str, str], line: str) -> None:
        """The same for lines unrelated to the pattern."""
        pattern, _ = case
        regex = _compiles(pattern)
        assume(regex is not None)
        if regex.search(line) is not None:
            assert _keeps(pattern, line), (pattern, line, required(pattern))

    def test_folding_stays_in_ascii_except_k_and_s(self) -> None:
        """The rule the filter's case-insensitive literals rest on: RE2's `(?i)` takes an
        ASCII letter only to its two ASCII cases, except k and s, which it folds with the Kelvin
        sign and the long s (so those never join a literal)."""
        everything = "".join(chr(c) for c in range(0x80, 0x110000) if not 0xD800 <= c <= 0xDFFF)
        assert set(re2.findall("(?i)[a-z]", everything)) == {"\u212a", "\u017f"}
        assert re2.search("(?i)k", "\u212a") and re2.search("(?i)s", "\u017f")

    @pytest.mark.parametrize(
        ("pattern", "line"),
        [
            ("(?i)kernel error", "\u212aernel error"),  # the Kelvin sign is a k to RE2
            ("(?i)segfault\\b", "\u017fegfault"),  # so is the long s an s
            ("\\bfoo\\b", "foo\u0130"),  # İ is no word character to RE2's \b
            ("x[]a]y", "x]y"),
            ("(?i)CUDA(?-i) error", "cuda error"),
            ("a{,3}b", "a{,3}b"),
            ("a|b(?i)C", "bc"),
            ("(?i)(?:{,3})é{", "{,3}É{"),  # a folded letter first in a run still splits it
        ],
    )
    def test_known_traps(self, pattern: str, line: str) -> None:
        """Cases where lowering the line or reading RE2's syntax naively would drop a match."""
        assert re2.search(pattern, line) is not None
        assert _keeps(pattern, line)


def _signature(index: int, pattern: str, priority: int, kind: str) -> Signature:
    return Signature(
        id=f"s{index}",
        title="t",
        severity=Severity.FATAL,
        remediation=None,
        priority=priority,
        source=None,
        kind=kind,
        domain="d",
        patterns=(pattern,),
        order=index,
    )


def eager_match(table: SignatureTable, text: str, frames: Sequence[str] = ()) -> Any:
    """The match as the table made it before the prefilter: every pattern tried on `text`."""
    text = text[: table.max_line_chars]
    hits = [
        (sig_index, pattern_index)
        for sig_index, signature in enumerate(table.signatures)
        for pattern_index in range(len(signature.patterns))
        if signature.compiled[pattern_index].search(text) is not None
    ]
    hits.sort(key=lambda hit: _rank(table.signatures[hit[0]]))
    for sig_index, pattern_index in hits:
        signature = table.signatures[sig_index]
        if signature.compiled_frames and not any(
            rx.search(f) for rx in signature.compiled_frames for f in frames
        ):
            continue
        m = signature.compiled[pattern_index].search(text)
        captures = {k: v for k, v in m.groupdict().items() if v is not None}
        return signature.id, captures, pattern_index
    return None


def _rank(signature: Signature) -> tuple[int, int, int]:
    return ({"noise": -2, "cause": -1, "wrapper": 0}[signature.kind], -signature.priority,
            signature.order)  # fmt: skip


def _seen(found: SignatureMatch | None) -> Any:
    if found is None:
        return None
    return found.signature.id, dict(found.captures), found.pattern_index


class TestSameMatchAsEveryPattern:
    @given(
        st.lists(
            st.tuples(
                st.one_of(pattern_and_line(), keyed_pattern_and_line()),
                st.integers(0, 3),
                st.sampled_from(["cause", "noise"]),
            ),
            min_size=1,
            max_size=8,
        ),
        st.text(alphabet=ALPHABET, max_size=6),
    )
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    def test_generated_tables(
        self, rows: list[tuple[tuple[str, str], int, str]], noise: str
    ) -> None:
        """A table of generated patterns, on lines built from each of them: the same best
        signature, pattern and captures as trying every pattern."""
        usable = [row for row in rows if _compiles(row[0][0]) is not None]
        assume(usable)
        table = SignatureTable(
            [_signature(i, pattern, p, kind) for i, ((pattern, _), p, kind) in enumerate(usable)]
        )
        for (_, line), _, _ in usable:
            for text in (line, noise + line, line + noise + line):
                assert _seen(table.match(text)) == eager_match(table, text)


@pytest.fixture(scope="module", name="shipped")
def _shipped() -> SignatureTable:
    return load_signature_table()


class TestTheShippedTable:
    @given(
        st.lists(st.sampled_from(VECTOR_LINES), min_size=1, max_size=3),
        st.lists(st.tuples(st.integers(0, 400), st.text(alphabet=ALPHABET, max_size=5))),
        st.sampled_from([str, str.lower, str.upper, str.swapcase]),
    )
    @settings(
        max_examples=400,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    def test_vector_lines_with_noise(
        self,
        shipped: SignatureTable,
        lines: list[str],
        edits: list[tuple[int, str]],
        case: Any,
    ) -> None:
        """The shipped table's example lines, joined, cased, with noise spliced in: the
        same match as trying every pattern."""
        text = case(" ".join(lines))
        for at, junk in edits:
            at %= len(text) + 1
            text = text[:at] + junk + text[at:]
        assert _seen(shipped.match(text)) == eager_match(shipped, text)

    def test_every_vector_line(self, shipped: SignatureTable) -> None:
        """Each example line as it is: the same match."""
        for line in VECTOR_LINES:
            assert _seen(shipped.match(line)) == eager_match(shipped, line)
