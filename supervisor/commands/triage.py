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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from supervisor.classify.signatures import SignatureTable
from supervisor.config import Config
from supervisor.environment.log import EnvironmentLog
from supervisor.errors import JournalError, SupervisorError
from supervisor.journal.export import ExportParser, Fields, decode
from supervisor.journal.reader import ReaderSettings, read_all
from supervisor.model import Action, Invocation, JournalEntry, LogLine, Outcome
from supervisor.pipeline import Pipeline
from supervisor.store import Store

JOURNAL_FILE_MAGIC = b"LPKSHHRH"


def triage(
    source: str,
    *,
    config: Config,
    table: SignatureTable,
    output_format: str = "text",
    out: TextIO = sys.stdout,
) -> int:
    """Classify `source` and print the outcomes; 0 when it ran."""
    outcomes = with_drift(collect(source, config=config, table=table), config.state.state_dir)
    if output_format == "json":
        json.dump({"invocations": [o.to_json() for o in outcomes]}, out, indent=2)
        out.write("\n")
    else:
        out.write(render_text(outcomes))
    return 0


def collect(source: str, *, config: Config, table: SignatureTable) -> list[Outcome]:
    """The outcomes of every failed or crashed invocation in `source`."""
    pipeline = Pipeline(config, table)
    path = Path(source)
    if source != "-" and path.is_dir():
        return _reported(_from_journal(pipeline, ReaderSettings(directory=path)))
    data = sys.stdin.buffer.read() if source == "-" else _read_file(path)
    if data.startswith(JOURNAL_FILE_MAGIC):
        return _reported(_from_journal(pipeline, ReaderSettings(files=(path,))))
    kind = sniff(data)
    if kind == "text":
        lines = data.decode("utf-8", "replace").splitlines()
        return [pipeline.decide(plain_text_invocation(lines))]
    entries = _decode_json(data) if kind == "json" else _decode_export(data)
    outcomes = pipeline.feed(entries)
    return _reported(outcomes + pipeline.finish())


def with_drift(outcomes: Sequence[Outcome], state_dir: Path) -> list[Outcome]:
    """The outcomes, each crash with what changed since its unit's last good start.

    The environments are the ones the daemon recorded on this host (its state database); a
    journal from elsewhere, or a database that cannot be read, leaves the outcomes as they are.
    """
    store = Store.existing_in_directory(state_dir)
    if store is None:
        return list(outcomes)
    try:
        envlog = EnvironmentLog(store)
        return [_drift_of(o, envlog) for o in outcomes]
    finally:
        store.close()


def _drift_of(outcome: Outcome, envlog: EnvironmentLog) -> Outcome:
    inv = outcome.invocation
    if inv.unit is None or inv.invocation_id is None or outcome.drift:
        return outcome
    try:
        changes = envlog.changes_since_last_good(inv.unit, inv.invocation_id)
    except SupervisorError:
        return outcome
    if not changes:
        return outcome
    return dataclasses.replace(outcome, drift=tuple(str(c) for c in changes))


def sniff(data: bytes) -> str:
    """'json', 'export' or 'text', from the first non-blank line."""
    first = data.lstrip()[:4096].split(b"\n", 1)[0]
    if first.startswith(b"{"):
        try:
            json.loads(first)
        except ValueError:
            return "text"
        return "json"
    key, sep, _ = first.partition(b"=")
    if sep and key.startswith((b"__CURSOR", b"__REALTIME", b"_", b"MESSAGE")) and key.isupper():
        return "export"
    return "text"


def plain_text_invocation(lines: Sequence[str]) -> Invocation:
    """One invocation of unknown unit from pasted log text."""
    kept = tuple(LogLine(text=line.rstrip("\r")) for line in lines)
    return Invocation(unit=None, invocation_id=None, lines=kept, total_lines=len(kept))


def render_text(outcomes: Sequence[Outcome]) -> str:
    """A person's view of the outcomes."""
    if not outcomes:
        return "No failed invocation found.\n"
    return "\n".join(_render_one(o) for o in outcomes)


def _render_one(outcome: Outcome) -> str:
    inv, verdict, decision = outcome.invocation, outcome.verdict, outcome.decision
    ended = f"{inv.exit_code or '?'} status={inv.exit_status}" if inv.exit_code else "no exit seen"
    rows = [
        f"{inv.unit or '(text)'}  invocation {inv.invocation_id or '-'}  {ended}"
        f" result={inv.result or '-'} restarts={inv.restarts} lines={inv.total_lines}",
        f"  verdict:     {verdict.severity.value.upper()} {verdict.signature or '-'}: "
        f"{verdict.title}",
        f"  root cause:  {verdict.root_cause or '(none found)'}",
    ]
    if verdict.crash_site and verdict.crash_site != verdict.root_cause:
        rows.append(f"  crash site:  {verdict.crash_site}")
    if verdict.captures:
        rows.append("  captures:    " + ", ".join(f"{k}={v}" for k, v in verdict.captures.items()))
    if verdict.remediation:
        rows.append(f"  remediation: {verdict.remediation}")
    if verdict.fingerprint:
        rows.append(f"  fingerprint: {verdict.fingerprint}")
    if outcome.drift:
        rows.append(f"  changed:     since the last good start: {'; '.join(outcome.drift)}")
    if inv.hung:
        rows.append("  engine hung: it logged its death and stayed up until the grace period ended")
    rows += [f"  note:        {note}" for note in verdict.notes]
    rows.append(f"  decision:    {decision.action.value.upper()}: {decision.reason}")
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


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise JournalError(f"{path}: cannot read: {exc.strerror}") from exc


def _decode_export(data: bytes) -> Iterator[JournalEntry]:
    parser = ExportParser()
    for index, fields in enumerate(parser.feed(data + b"\n\n")):
        entry = decode(_with_cursor(fields, index))
        if entry is not None:
            yield entry


def _decode_json(data: bytes) -> Iterator[JournalEntry]:
    for index, line in enumerate(data.splitlines()):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise JournalError(f"line {index + 1}: not a JSON journal entry: {exc}") from exc
        if not isinstance(record, dict):
            raise JournalError(f"line {index + 1}: expected a JSON object")
        entry = decode(_with_cursor(_json_fields(record), index))
        if entry is not None:
            yield entry


def _json_fields(record: dict[str, Any]) -> Fields:
    """journalctl -o json quirks: bytes as arrays of numbers, repeated fields as lists, null."""
    fields: Fields = {}
    for key, value in record.items():
        if isinstance(value, list) and value and isinstance(value[0], list):
            value = value[-1]  # a repeated field: keep the last value
        if isinstance(value, list):
            fields[key.encode()] = bytes(v & 0xFF for v in value if isinstance(v, int))
        elif isinstance(value, str):
            fields[key.encode()] = value.encode()
        elif value is not None:
            fields[key.encode()] = str(value).encode()
    return fields


def _with_cursor(fields: Fields, index: int) -> Fields:
    if b"__CURSOR" not in fields:
        fields[b"__CURSOR"] = f"input:{index}".encode()
    return fields
