"""`vllm-supervisor triage`: classify every failed invocation of a saved journal.

The input kind is detected: a journal directory or file (read with journalctl, exactly as the
daemon reads), `journalctl -o export` output, `journalctl -o json` lines, or plain text (one
invocation). Everything then goes through the daemon's own `Pipeline`: each ended invocation
is decided by the same `Pipeline.decide`, on the same evidence record, the drift as the daemon
recorded it on this host (its state database).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from ..classify import SignatureTable, load_table
from ..config import Config, load_config, with_units
from ..environment import RecordedDrift
from ..journal import (
    JOURNAL_FILE_MAGIC,
    ReaderSettings,
    decode_export,
    decode_json,
    plain_text_invocation,
    read_all,
    read_driver_lines,
    read_file,
    sniff,
)
from ..model import Action, Ended, Outcome
from ..pipeline import KernelLine, Pipeline, Provider
from ..story import NO_ROOT_CAUSE, decided, shown
from ..util.text import for_terminal, visible
from .options import config_path

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
        outcomes = collect(source, config=config, table=table)
    except NoEntries:
        print(f"vllm-supervisor: triage: {source}: no journal entries", file=sys.stderr)
        return EXIT_NO_ENTRIES
    if output_format == "json":
        json.dump({"invocations": [o.to_json() for o in outcomes]}, out, indent=2)
        out.write("\n")
    else:
        out.write(for_terminal(render_text(outcomes)))
    return 0


def collect(
    source: str, *, config: Config, table: SignatureTable, providers: Sequence[Provider] = ()
) -> list[Outcome]:
    """The outcomes of every failed or crashed invocation in `source`; `providers` add
    evidence `triage` itself never gathers (the bench's replay of the daemon's live host)."""
    pipeline = Pipeline(config, table)
    drift = RecordedDrift(config.state.state_dir)
    kernel: list[KernelLine] = []
    try:
        ended = _ended(source, pipeline, kernel)
        gpu_faults = pipeline.gpu_faults(kernel)
        return _reported(pipeline.decide_all(ended, [drift.evidence, gpu_faults, *providers]))
    finally:
        drift.close()


def _ended(source: str, pipeline: Pipeline, kernel: list[KernelLine]) -> list[Ended]:
    """Every invocation of `source` that ended (or was still open at its end), read; for a
    journal, the driver's kernel lines go to `kernel` (exported or pasted text has no trusted
    transport: its `NVRM:` lines are the units' own, never the kernel's)."""
    path = Path(source)
    journalctl = pipeline.config.journal.journalctl
    if source != "-" and path.is_dir():
        kernel += read_driver_lines(journalctl, directory=path)
        return _from_journal(pipeline, ReaderSettings(directory=path))
    data = sys.stdin.buffer.read() if source == "-" else read_file(path)
    if data.startswith(JOURNAL_FILE_MAGIC):
        kernel += read_driver_lines(journalctl, files=(path,))
        return _from_journal(pipeline, ReaderSettings(files=(path,)))
    if not data.strip():
        raise NoEntries(source)
    kind = sniff(data)
    if kind == "text":
        lines = data.decode("utf-8", "replace").splitlines()
        return [pipeline.examine(plain_text_invocation(lines))]
    entries = list(decode_json(data) if kind == "json" else decode_export(data))
    if not entries:
        raise NoEntries(source)
    return pipeline.feed(entries) + pipeline.finish()


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


def _from_journal(pipeline: Pipeline, settings: ReaderSettings) -> list[Ended]:
    settings = dataclasses.replace(
        settings,
        units=tuple(u.name for u in pipeline.config.units),
        journalctl=pipeline.config.journal.journalctl,
        source=pipeline.config.journal.reader,
        max_line_chars=pipeline.config.tracker.max_line_chars,
    )

    async def run() -> list[Ended]:
        ended: list[Ended] = []
        async for batch in read_all(settings):
            ended += pipeline.feed(batch)
        return ended + pipeline.finish()

    return asyncio.run(run())


def main(args: argparse.Namespace) -> int:
    """`triage`: classify a saved journal with the daemon's own pipeline."""
    config = with_units(load_config(config_path(args)), args.unit)
    return triage(args.source, config=config, table=load_table(config), output_format=args.format)
