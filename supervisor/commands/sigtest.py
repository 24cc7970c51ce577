"""`vllm-supervisor signatures test FILE`: the verdict, and which signature matched which line.

For the root-cause line it also lists every signature of the same domain that did *not* match and
why, so a table author sees at once whether a pattern is too narrow or shadowed.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from ..classify import Classifier, SignatureTable, parse_line
from ..journal import plain_text_invocation, read_file
from ..model import LogLine
from ..util.text import for_terminal, visible


def signatures_test(source: str, table: SignatureTable, *, out: TextIO | None = None) -> int:
    """Print the verdict for FILE and the per-line matches (to standard output by default); 0
    when it ran."""
    out = out or sys.stdout
    raw = _read(source).decode("utf-8", "replace")
    invocation = plain_text_invocation(raw.splitlines())
    report = io.StringIO()
    _report(invocation.lines, table, report)
    out.write(for_terminal(report.getvalue()))
    return 0


def _read(source: str) -> bytes:
    """The log's bytes; JournalError (one line) when it cannot be read."""
    if source == "-":
        return sys.stdin.buffer.read()
    return read_file(Path(source))


def _report(lines: Sequence[LogLine], table: SignatureTable, out: TextIO) -> None:
    """The verdict, the matched lines and why; what came from the log is shown `visible`."""
    verdict = Classifier(table).classify(lines)
    out.write(f"verdict:    {verdict.severity.value} {verdict.signature or '-'}: {verdict.title}\n")
    out.write(f"root cause: {visible(verdict.root_cause or '(none)')}\n")
    out.write("\nlines matched by a signature:\n")
    for number, line in enumerate(lines, start=1):
        text = parse_line(line).text
        match = table.match(text)
        if match is not None:
            sig = match.signature
            captures = ", ".join(f"{k}={v}" for k, v in match.captures.items())
            out.write(
                f"  line {number}: {sig.id} ({sig.kind}, {sig.severity.value}, pattern "
                f"{match.pattern_index}{', ' + visible(captures) if captures else ''})\n"
                f"    {visible(text[:200])}\n"
            )
    if verdict.root_cause:
        out.write("\nwhy each signature did or did not match the root cause:\n")
        for explanation in table.explain(verdict.root_cause):
            mark = "MATCH" if explanation.matched else "no   "
            out.write(f"  {mark} {explanation.signature.id}: {visible(explanation.reason)}\n")
