"""A saved journal in the forms an operator has at hand, decoded into entries.

`journalctl -o export` output, `journalctl -o json` lines, or pasted plain text (one
invocation of an unknown unit); a journal directory or file is read by the reader itself
(journal.reader, as the daemon reads). `sniff` tells the forms apart.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import JournalError
from ..model import Invocation, JournalEntry, LogLine
from ..util.jsontext import loads
from .export import ExportParser, Fields, decode

JOURNAL_FILE_MAGIC = b"LPKSHHRH"  # the first bytes of a binary journal file


def sniff(data: bytes) -> str:
    """'json', 'export' or 'text', from the first non-blank line."""
    first = data.lstrip()[:4096].split(b"\n", 1)[0]
    if first.startswith(b"{"):
        try:
            loads(first)
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


def read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise JournalError(f"{path}: cannot read: {exc.strerror}") from exc


def decode_export(data: bytes) -> Iterator[JournalEntry]:
    parser = ExportParser()
    for index, fields in enumerate(parser.feed(data + b"\n\n")):
        entry = decode(_with_cursor(fields, index))
        if entry is not None:
            yield entry


def decode_json(data: bytes) -> Iterator[JournalEntry]:
    for index, line in enumerate(data.splitlines()):
        if not line.strip():
            continue
        try:
            record = loads(line)
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
