"""Outside text made safe to print on a terminal: control characters shown, never obeyed.

A crash line is written by the crashed program (and through it by whoever fed it input): an
OSC title, a CSI screen clear or an OSC 52 clipboard write in it must reach the operator as
the characters `\\x1b]52;...`, not as an action of their terminal. Every text renderer of the
command line passes what it prints through `for_terminal`, and each outside value through
`visible`, so a newline inside a value cannot forge a line of the output either.
"""

from __future__ import annotations

import unicodedata

# Shown as `\xNN` / `\uNNNN`: C0, DEL and C1 controls (Cc), the line and paragraph separators,
# and the bidirectional overrides that reorder what a reader sees ("Trojan source").
_BIDI = (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C)
_SHOWN = {
    code
    for code in (*range(0xA0), 0x2028, 0x2029, *_BIDI)
    if code > 0xFF or unicodedata.category(chr(code)) == "Cc"
}


def _escape(code: int) -> str:
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


_VISIBLE = {code: _escape(code) for code in _SHOWN}
_LAYOUT = {code: _escape(code) for code in _SHOWN - {ord("\n"), ord("\t")}}


def visible(text: str) -> str:
    """`text` with every control character shown as its escape (newline and tab included)."""
    return text.translate(_VISIBLE)


def for_terminal(text: str) -> str:
    """A rendered screen: control characters shown, except the newlines and tabs of its own
    layout."""
    return text.translate(_LAYOUT)


CUT = "…"  # what ends a value cut to its bound


def bounded(text: str, limit: int) -> str:
    """`text` as a record keeps a value from outside (a reason quoting a command line): its
    control characters escaped (`visible`), at most `limit` characters and the mark it was cut."""
    shown = visible(text)
    return shown if len(shown) <= limit else shown[:limit] + CUT
