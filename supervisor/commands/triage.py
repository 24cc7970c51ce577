"""`vllm-supervisor triage`: classify every failed invocation of a saved journal.

The input kind is detected: a journal directory or file (read with journalctl, exactly as the
daemon reads), `journalctl -o export` output, `journalctl -o json` lines, or plain text (one
invocation). Everything then goes through the daemon's own `Pipeline`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from ..classify.signatures import SignatureTable
from ..config import Config
from ..environment.drift import with_recorded_drift
from ..journal.reader import ReaderSettings, read_all
from ..journal.saved import (
    JOURNAL_FILE_MAGIC,
    decode_export,
    decode_json,
    plain_text_invocation,
    read_file,
    sniff,
)
from ..model import Action, Outcome
from ..pipeline import Pipeline
from ..story import NO_ROOT_CAUSE, decided, shown
from ..util.text import for_terminal, visible

EXIT_NO_ENTRIES = 2


class NoEntries(Exception):
    """The input holds no journal entry and no log line: there is nothing to triage."""


def triage(
    source: str,
    *,
    config: Config,
    table: SignatureTable,
    output_format: str = "text",
    out: TextIO | None = None,
) -> int:
    """Classify `source` and print the outcomes (to standard output by default); 0 when it ran,
    2 (one line on standard error) when the input holds no journal entries."""
    out = out or sys.stdout
    try:
        found = collect(source, config=config, table=table)
    except NoEntries:
        print(f"triage: {source}: no journal entries", file=sys.stderr)
        return EXIT_NO_ENTRIES
    outcomes = with_recorded_drift(found, config.state.state_dir)
    if output_format == "json":
        json.dump({"invocations": [o.to_json() for o in outcomes]}, out, indent=2)
        out.write("\n")
    else:
        out.write(for_terminal(render_text(outcomes)))
    return 0


def collect(source: str, *, config: Config, table: SignatureTable) -> list[Outcome]:
    """The outcomes of every failed or crashed invocation in `source`."""
    pipeline = Pipeline(config, table)
    path = Path(source)
    if source != "-" and path.is_dir():
        return _reported(_from_journal(pipeline, ReaderSettings(directory=path)))
    data = sys.stdin.buffer.read() if source == "-" else read_file(path)
    if data.startswith(JOURNAL_FILE_MAGIC):
        return _reported(_from_journal(pipeline, ReaderSettings(files=(path,))))
    if not data.strip():
        raise NoEntries(source)
    kind = sniff(data)
    if kind == "text":
        lines = data.decode("utf-8", "replace").splitlines()
        return [pipeline.decide(plain_text_invocation(lines))]
    entries = list(decode_json(data) if kind == "json" else decode_export(data))
    if not entries:
        raise NoEntries(source)
    outcomes = pipeline.feed(entries)
    return _reported(outcomes + pipeline.finish())


def render_text(outcomes: Sequence[Outcome]) -> str:
    """A person's view of the outcomes."""
    if not outcomes:
        return "No failed invocation found.\n"
    return "\n".join(_render_one(o) for o in outcomes)


def _render_one(outcome: Outcome) -> str:
    """One outcome; every value that came from the journal is shown `visible`."""
    inv, verdict, decision = outcome.invocation, outcome.verdict, outcome.decision
    ended = f"{inv.exit_code} status={shown(inv.exit_status)}" if inv.exit_code else "no exit seen"
    rows = [
        visible(
            f"{inv.unit or '(text)'}  invocation {inv.invocation_id or '-'}  {ended}"
            f" result={inv.result or '-'} restarts={shown(inv.restarts)} lines={inv.total_lines}"
        ),
        visible(
            f"  verdict:     {verdict.severity.value.upper()} {verdict.signature or '-'}: "
            f"{verdict.title}"
        ),
        f"  root cause:  {visible(verdict.root_cause or NO_ROOT_CAUSE)}",
    ]
    if verdict.crash_site and verdict.crash_site != verdict.root_cause:
        rows.append(f"  crash site:  {visible(verdict.crash_site)}")
    if verdict.captures:
        captures = ", ".join(f"{k}={v}" for k, v in verdict.captures.items())
        rows.append(f"  captures:    {visible(captures)}")
    if verdict.remediation:
        rows.append(f"  remediation: {visible(verdict.remediation)}")
    if verdict.fingerprint:
        rows.append(f"  fingerprint: {verdict.fingerprint}")
    if outcome.drift:
        drift = visible("; ".join(outcome.drift))
        rows.append(f"  changed:     since the last good start: {drift}")
    if inv.hung:
        rows.append("  engine hung: it logged its death and stayed up until the grace period ended")
    rows += [f"  note:        {visible(note)}" for note in verdict.notes]
    rows.append(f"  decision:    {decided(decision.action.value)}: {visible(decision.reason)}")
    return "\n".join(rows) + "\n"


def _reported(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """Failed or crashed invocations only; clean stops and skipped starts are not news."""
    return [
        o
        for o in outcomes
        if o.decision.action is not Action.OBSERVE or o.invocation.failed or o.verdict.crashed
    ]


def _from_journal(pipeline: Pipeline, settings: ReaderSettings) -> list[Outcome]:
    settings = dataclasses.replace(
        settings,
        units=tuple(u.name for u in pipeline.config.units),
        journalctl=pipeline.config.journal.journalctl,
        source=pipeline.config.journal.reader,
        max_line_chars=pipeline.config.tracker.max_line_chars,
    )

    async def run() -> list[Outcome]:
        outcomes: list[Outcome] = []
        async for batch in read_all(settings):
            outcomes += pipeline.feed(batch)
        return outcomes + pipeline.finish()

    return asyncio.run(run())
