"""`vllm-supervisor signatures test FILE`: the verdict, and which signature matched which line.

For the root-cause line it also lists every signature of the same domain that did *not* match and
why, so a table author sees at once whether a pattern is too narrow or shadowed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from ..classify.classifier import Classifier
from ..classify.logline import parse_line
from ..classify.signatures import SignatureTable
from ..journal.saved import plain_text_invocation


def signatures_test(source: str, table: SignatureTable, *, out: TextIO = sys.stdout) -> int:
    """Print the verdict for FILE and the per-line matches; 0 when it ran."""
    raw = sys.stdin.read() if source == "-" else Path(source).read_text("utf-8", "replace")
    invocation = plain_text_invocation(raw.splitlines())
    verdict = Classifier(table).classify(invocation.lines)
    out.write(f"verdict:    {verdict.severity.value} {verdict.signature or '-'}: {verdict.title}\n")
    out.write(f"root cause: {verdict.root_cause or '(none)'}\n")
    out.write("\nlines matched by a signature:\n")
    for number, line in enumerate(invocation.lines, start=1):
        text = parse_line(line).text
        match = table.match(text)
        if match is not None:
            sig = match.signature
            captures = ", ".join(f"{k}={v}" for k, v in match.captures.items())
            out.write(
                f"  line {number}: {sig.id} ({sig.kind}, {sig.severity.value}, pattern "
                f"{match.pattern_index}{', ' + captures if captures else ''})\n    {text[:200]}\n"
            )
    if verdict.root_cause:
        out.write("\nwhy each signature did or did not match the root cause:\n")
        for explanation in table.explain(verdict.root_cause):
            mark = "MATCH" if explanation.matched else "no   "
            out.write(f"  {mark} {explanation.signature.id}: {explanation.reason}\n")
    return 0
