"""A streaming parser of journal export format, and its decoding into `JournalEntry`.

Export format (systemd's JOURNAL_EXPORT_FORMATS): one `KEY=VALUE` line per text field, a blank
line after each entry; a field that is not printable text (tqdm's `\\r`, non-UTF-8 bytes, a
newline) is `KEY\\n`, a little-endian 64-bit length and the raw bytes. Unlike `-o json` it keeps
fields over 4096 bytes and never turns bytes into arrays of numbers, and journalctl writes it about
three times faster.

The parser splits on the blank line first and builds each entry with one `dict()` call; an entry
holding a binary field makes that call fail (its name line has no `=`), and only such entries take
the exact, slower path. Bad data never raises: it is skipped and counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..model import EMPTY, JournalEntry, field_int

try:  # the rows' parser in C (setup.py builds it with any C compiler; optional)
    from . import _rows as _native_rows
except ImportError:  # a build without a C compiler: the Python loop below
    _native_rows = None  # type: ignore[assignment]
try:  # the export format's parser in C, likewise (`_export.c`)
    from . import _export as _native_export
except ImportError:
    _native_export = None  # type: ignore[assignment]

Fields = dict[bytes, bytes]

LIFECYCLE_FIELDS = (
    b"EXIT_CODE",
    b"EXIT_STATUS",
    b"UNIT_RESULT",
    b"N_RESTARTS",
    b"JOB_RESULT",
    b"JOB_TYPE",
    b"N_DROPPED",
    b"COMMAND",  # which process exited: ExecStart (the main one), ExecCondition, ...
    b"OBJECT_SYSTEMD_INVOCATION_ID",  # journald's "Suppressed": whose line came after the gap
)
# The fields of the native reader's row, in order: `LineParser.feed` unpacks them by position.
LINE_FIELDS = (
    b"MESSAGE_ID",
    b"PRIORITY",
    b"_PID",
    b"_SYSTEMD_UNIT",
    b"_SYSTEMD_INVOCATION_ID",
    b"UNIT",
    b"INVOCATION_ID",
    b"OBJECT_SYSTEMD_UNIT",
    b"_UID",
    b"_MACHINE_ID",
    b"_HOSTNAME",
    b"_BOOT_ID",
    *LIFECYCLE_FIELDS,
)
# What journalctl is asked for (--output-fields); __CURSOR and the timestamps always come.
OUTPUT_FIELDS = (b"MESSAGE", *LINE_FIELDS)
CUT_MARKER = "…[cut]"
"""The end of a MESSAGE cut to `max_line_chars` characters (what was cut is not kept)."""
_LENGTH_BYTES = 8


@dataclass(slots=True)
class ExportParser:
    """Turns chunks of `journalctl -o export` output into field dicts, keeping partial data."""

    max_value_bytes: int = 1 << 20
    invalid: int = 0  # entries skipped because they could not be parsed
    _buffer: bytes = b""
    _pending: list[Fields] = field(default_factory=list)

    def feed(self, chunk: bytes) -> list[Fields]:
        """Parse what `chunk` completes; return the complete entries in order."""
        buf = self._buffer + chunk if self._buffer else chunk
        entries: list[Fields] = []
        pos = 0
        size = len(buf)
        while pos < size:
            end = buf.find(b"\n\n", pos)
            if end < 0:
                break
            try:
                # A list, not a generator: no frame resumed per field (~25% faster here).
                entries.append(dict([line.split(b"=", 1) for line in buf[pos:end].split(b"\n")]))
                pos = end + 2
            except ValueError:
                parsed = self._parse_exact(buf, pos)
                if parsed is None:
                    break
                fields, pos = parsed
                if fields:
                    entries.append(fields)
        self._buffer = buf[pos:]
        return entries

    def _parse_exact(self, buf: bytes, pos: int) -> tuple[Fields, int] | None:
        """Parse one entry field by field; None when `buf` ends inside it."""
        fields: Fields = {}
        size = len(buf)
        while True:
            newline = buf.find(b"\n", pos)
            if newline < 0:
                return None
            if newline == pos:  # the blank line that ends the entry
                return fields, pos + 1
            line = buf[pos:newline]
            key, sep, value = line.partition(b"=")
            if sep:
                fields[key] = value
                pos = newline + 1
                continue
            start = newline + 1 + _LENGTH_BYTES
            if start > size:
                return None
            length = int.from_bytes(buf[newline + 1 : start], "little")
            if length > self.max_value_bytes * 64:
                # No journal field is this large: the stream is out of step. Resynchronise at
                # the next blank line rather than buffering forever.
                self.invalid += 1
                skip = buf.find(b"\n\n", newline)
                return ({}, skip + 2) if skip >= 0 else None
            if start + length + 1 > size:
                return None
            fields[key] = buf[start : start + length]
            pos = start + length + 1


@dataclass(slots=True)
class ExportDecoder:
    """journalctl's export output to entries, keeping only the units' when `units` is given.

    `ExportParser`, `about` and `decode` in turn, or the same in one C loop (`_export.c`)
    where it was built: no dict per entry, and an entry of another unit is dropped before any
    of it is decoded. `parsed` counts the entries of any unit; `feed` reports the first and
    last cursor of everything parsed (other units' entries move the checkpoint too).
    """

    max_chars: int = 16384
    units: frozenset[bytes] = frozenset()
    native: bool = True
    max_value_bytes: int = 1 << 20
    parsed: int = 0
    _invalid: int = 0
    _buffer: bytes = b""
    _parser: ExportParser = field(default_factory=ExportParser)

    @property
    def invalid(self) -> int:
        """Entries skipped because they could not be parsed."""
        return self._invalid + self._parser.invalid

    @property
    def pending(self) -> bytes:
        """The bytes of an entry not yet complete."""
        return self._buffer + self._parser._buffer

    def feed(self, chunk: bytes) -> tuple[list[JournalEntry], bytes | None, bytes | None]:
        """The entries `chunk` completes, and the first and last record's cursor (raw)."""
        if self.native and _native_export is not None:
            buf = self._buffer + chunk if self._buffer else chunk
            entries, first, last, consumed, invalid, parsed = _native_export.parse(
                buf, self.max_chars, self.max_value_bytes * 64, self.units or None
            )
            self._invalid += invalid
            self.parsed += parsed
            self._buffer = buf[consumed:]
            return entries, first, last
        self._parser.max_value_bytes = self.max_value_bytes
        raw = self._parser.feed(chunk)
        if not raw:
            return [], None, None
        self.parsed += len(raw)
        first, last = raw[0].get(b"__CURSOR", b""), raw[-1].get(b"__CURSOR")
        if self.units:
            raw = [fields for fields in raw if about(fields, self.units)]
        return decode_all(raw, max_chars=self.max_chars), first, last


def about(fields: Fields, units: frozenset[bytes]) -> bool:
    """Is this entry the units' own line, or a message about one of them (what -u matches)?

    `journalctl --unit=U --follow` on systemd 252 never delivers entries of a unit that had
    none when it started (seen in the nspawn end-to-end test: 1 entry with --unit, 221 without),
    and the supervisor normally starts before the server it watches. So the follower reads
    every entry and the match is made here, on the raw fields, before decoding.
    """
    return (
        fields.get(b"_SYSTEMD_UNIT") in units
        or fields.get(b"UNIT") in units
        or fields.get(b"OBJECT_SYSTEMD_UNIT") in units
    )


def decode(fields: Fields, *, max_chars: int = 16384) -> JournalEntry | None:
    """Build a `JournalEntry` from raw fields; None when the entry has no cursor."""
    get = fields.get
    cursor = get(b"__CURSOR")
    if cursor is None:
        return None
    message_id = get(b"MESSAGE_ID")
    pid = get(b"_PID")
    # PID 1 logs *about* a unit with UNIT=; its own _SYSTEMD_UNIT is init.scope. Any process can
    # write UNIT= or OBJECT_SYSTEMD_UNIT=, so they count only from a trusted sender.
    trusted = pid == b"1" or get(b"_UID") == b"0"
    about = get(b"UNIT") if trusted else None
    unit: bytes | None
    if about is not None:
        unit, invocation = about, get(b"INVOCATION_ID")
    elif trusted and (obj := get(b"OBJECT_SYSTEMD_UNIT")) is not None:
        unit, invocation = obj, None
    else:
        unit, invocation = get(b"_SYSTEMD_UNIT"), get(b"_SYSTEMD_INVOCATION_ID")
    return _new_entry(
        cursor.decode("ascii", "replace"),
        field_int(get(b"__REALTIME_TIMESTAMP")) or 0,
        _message(get(b"MESSAGE", b""), max_chars),
        unit.decode("utf-8", "replace") if unit is not None else None,
        invocation.decode("ascii", "replace") if invocation is not None else None,
        field_int(pid),
        field_int(get(b"PRIORITY")),
        message_id.decode("ascii", "replace") if message_id is not None else None,
        pid == b"1",
        _lifecycle(fields) if message_id is not None else EMPTY,
        _text(get(b"_MACHINE_ID")),
        _text(get(b"_HOSTNAME")),
        _text(get(b"_BOOT_ID")),
    )


def _text(value: bytes | None) -> str | None:
    """An optional identifier field, decoded; empty counts as absent."""
    return value.decode("utf-8", "replace") if value else None


def _message(raw: bytes, max_chars: int) -> str:
    if len(raw) <= max_chars and b"\r" not in raw and b"\x00" not in raw:
        return raw.decode("utf-8", "replace")  # what message_text returns for such a line
    return message_text(raw, max_chars)


_LINE_COLUMNS = 2 + len(LINE_FIELDS) + 1  # cursor, realtime, the fields, the message's length
_LIFECYCLE_AT = _LINE_COLUMNS - 1 - len(LIFECYCLE_FIELDS)  # the lifecycle fields come last
_LIFECYCLE_NAMES = tuple(name.decode() for name in LIFECYCLE_FIELDS)


@dataclass(slots=True)
class LineParser:
    """Turns the native reader's lean framing (`journal_reader.c`, `write_lines`) into entries.

    One tab-separated row per entry (cursor, realtime, the fields of `LINE_FIELDS`, the length of
    the message), then the message bytes and a newline: one `split` per entry instead of a dict
    of KEY=VALUE lines, and no dict at all. An absent field is empty, so an empty field counts as
    absent here (`decode` would keep an empty UNIT=; no unit is named ""). A row with only a
    cursor moves the checkpoint past entries of other units; a row `#N` answers the parent's
    sync request N (everything before it in the journal has been read): `synced` is the highest.
    """

    max_chars: int = 16384
    invalid: int = 0
    synced: int = 0
    _buffer: bytes = b""
    native: bool = True  # the same loop in C (`_rows.c`) where it was built

    def feed(self, chunk: bytes) -> tuple[list[JournalEntry], bytes | None, bytes | None]:
        """The entries `chunk` completes, and the first and last record's cursor (raw)."""
        buf = self._buffer + chunk if self._buffer else chunk
        if self.native and _native_rows is not None:
            entries, first, last, consumed, invalid, synced = _native_rows.parse(
                buf, self.max_chars
            )
            self.invalid += invalid
            self.synced = max(self.synced, synced)
            self._buffer = buf[consumed:]
            return entries, first, last
        return self._feed(buf)

    def _feed(self, buf: bytes) -> tuple[list[JournalEntry], bytes | None, bytes | None]:
        entries: list[JournalEntry] = []
        first: bytes | None = None
        last: bytes | None = None
        pos = 0
        size = len(buf)
        find = buf.find
        max_chars = self.max_chars
        last_identity: tuple[bytes, ...] | None = None
        decoded: tuple[Any, ...] = ()
        while (newline := find(b"\n", pos)) >= 0:
            row = buf[pos:newline].split(b"\t")
            if len(row) != _LINE_COLUMNS or not (row[-1].isascii() and row[-1].isdigit()):
                if len(row) == 1 and row[0][:1] == b"#":  # a sync answer
                    number = row[0][1:]
                    if number.isascii() and number.isdigit():
                        self.synced = max(self.synced, int(number))
                    else:
                        self.invalid += 1
                elif len(row) == 1:  # a cursor-only record
                    last = row[0]
                    first = first or last
                else:
                    self.invalid += 1  # out of step: resynchronise at the next line
                pos = newline + 1
                continue
            # The order of LINE_FIELDS; the lifecycle fields are sliced only when needed.
            (
                cursor,
                realtime,
                message_id,
                priority,
                pid,
                service_unit,
                service_invocation,
                about_unit,
                about_invocation,
                object_unit,
                uid,
                machine_id,
                hostname,
                boot_id,
            ) = row[:_LIFECYCLE_AT]
            length = row[-1]
            end = newline + 1 + int(length)
            if end >= size:
                break
            trusted = pid == b"1" or uid == b"0"  # as in `decode`
            unit, invocation = (
                (about_unit, about_invocation)
                if about_unit and trusted
                else (object_unit, b"")
                if object_unit and trusted
                else (service_unit, service_invocation)
            )
            raw = buf[newline + 1 : end]
            # _message's fast path, inline: this loop runs once per entry.
            if len(raw) <= max_chars and b"\r" not in raw and b"\x00" not in raw:
                message = raw.decode("utf-8", "replace")
            else:
                message = message_text(raw, max_chars)
            # Consecutive lines of one process repeat the same identity fields: decode them
            # once, then reuse the strings while the raw bytes stay the same.
            identity = (unit, invocation, pid, priority, machine_id, hostname, boot_id)
            if identity != last_identity:
                last_identity = identity
                decoded = (
                    unit.decode("utf-8", "replace") if unit else None,
                    invocation.decode("ascii", "replace") if invocation else None,
                    int(pid) if pid.isascii() and pid.isdigit() else None,
                    int(priority) if priority.isascii() and priority.isdigit() else None,
                    machine_id.decode("ascii", "replace") if machine_id else None,
                    hostname.decode("utf-8", "replace") if hostname else None,
                    boot_id.decode("ascii", "replace") if boot_id else None,
                )
            unit_s, invocation_s, pid_i, priority_i, machine_s, hostname_s, boot_s = decoded
            entries.append(
                _new_entry(
                    cursor.decode("ascii", "replace"),
                    int(realtime) if realtime.isascii() and realtime.isdigit() else 0,
                    message,
                    unit_s,
                    invocation_s,
                    pid_i,
                    priority_i,
                    message_id.decode("ascii", "replace") if message_id else None,
                    pid == b"1",
                    _lifecycle_row(row[_LIFECYCLE_AT:-1]) if message_id else EMPTY,
                    machine_s,
                    hostname_s,
                    boot_s,
                )
            )
            last = cursor
            first = first or cursor
            pos = end + 1
        self._buffer = buf[pos:]
        return entries, first, last


def _lifecycle_row(values: list[bytes]) -> dict[str, str]:
    return {
        key: value.decode("utf-8", "replace")
        for key, value in zip(_LIFECYCLE_NAMES, values, strict=True)
        if value
    }


def _entry_factory() -> Callable[..., JournalEntry]:
    """`JournalEntry(...)` by position, without the frozen dataclass's `__init__`.

    A frozen dataclass sets each field through `object.__setattr__` (~3.5 us for the thirteen
    fields of an entry here, a fifth of the per-entry budget); the slots' own descriptors do the
    same job in ~1.3 us. The result is an ordinary, equal, still-frozen `JournalEntry`.
    """
    cls: Any = JournalEntry
    setters = [getattr(cls, name).__set__ for name in cls.__slots__]
    if tuple(cls.__slots__) != tuple(f.name for f in dataclasses.fields(JournalEntry)):
        raise RuntimeError("JournalEntry's slots no longer follow its fields")
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12 = setters
    new = object.__new__

    def make(*values: Any) -> JournalEntry:
        entry = new(cls)
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12 = values
        s0(entry, v0)
        s1(entry, v1)
        s2(entry, v2)
        s3(entry, v3)
        s4(entry, v4)
        s5(entry, v5)
        s6(entry, v6)
        s7(entry, v7)
        s8(entry, v8)
        s9(entry, v9)
        s10(entry, v10)
        s11(entry, v11)
        s12(entry, v12)
        return entry  # type: ignore[no-any-return]

    return make


_new_entry = _entry_factory()


def message_text(raw: bytes, max_chars: int) -> str:
    """The printable text of a MESSAGE: bounded, decoded leniently, as a terminal would show it.

    A tqdm bar rewrites its line with `\\r`; only the last state is what a person saw. The cut
    happens on bytes first so a 1 MB line costs one slice, not a decode of the whole line. A cut
    message keeps its head and ends in CUT_MARKER, within `max_chars`.
    """
    cut = len(raw) > max_chars * 4  # the reader child cuts at a threshold above this (reader.py)
    if cut:
        raw = raw[: max_chars * 4]
    text = raw.decode("utf-8", "replace")
    if "\r" in text:
        text = text.rstrip("\r\n")
        text = text.rsplit("\r", 1)[-1]
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if cut or len(text) > max_chars:
        return (text[: max(0, max_chars - len(CUT_MARKER))] + CUT_MARKER)[:max_chars]
    return text


def decode_all(entries: Iterable[Fields], *, max_chars: int = 16384) -> list[JournalEntry]:
    """Decode many entries, dropping those without a cursor."""
    result = []
    for fields in entries:
        entry = decode(fields, max_chars=max_chars)
        if entry is not None:
            result.append(entry)
    return result


def _lifecycle(fields: Fields) -> dict[str, str]:
    return {
        key.decode(): value.decode("utf-8", "replace")
        for key in LIFECYCLE_FIELDS
        if (value := fields.get(key)) is not None
    }


def native_rows_available() -> bool:
    """Was the rows' parser in C built (`_rows.c`)?"""
    return _native_rows is not None


def native_export_available() -> bool:
    """Was the export format's parser in C built (`_export.c`)?"""
    return _native_export is not None


if _native_rows is not None:
    _native_rows.configure(
        JournalEntry, JournalEntry.__slots__, _LIFECYCLE_NAMES, message_text, EMPTY
    )
if _native_export is not None:
    _native_export.configure(
        JournalEntry, JournalEntry.__slots__, LIFECYCLE_FIELDS, message_text, field_int, EMPTY
    )
