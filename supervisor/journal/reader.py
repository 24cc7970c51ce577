"""Follow (or read once) the journal through a child process that writes export format.

A subprocess, not an in-process libsystemd reader: readers linked to libsystemd have crashed with
SIGBUS while journald rotated files before systemd 255, and a crash of the reader must not take
the supervisor with it. Vector, Filebeat and the OpenTelemetry collector do the same.

The child is either `journalctl -o export` or our own libsystemd reader, a C program installed
beside this module (`journal_reader.c`, ~4x faster: it writes only the fields the pipeline reads,
in a lean framing that costs Python half as much to parse as export format; `export.LineParser`).
Both take the same start points and report the first and last cursor of what they read, so
cursors, the skip of the resumed entry and restarts are shared; `ReaderSettings.source` picks.

Resuming: `--after-cursor` combined with `-u` skipped a line before systemd PR #30336 (Dec 2023;
this machine has 252), so the reader seeks with the inclusive `--cursor` and drops the one entry
whose cursor equals the saved one. When the first entry is another one, the saved entry is gone
(its file was vacuumed): journalctl 252 then seeks by seqnum, monotonic or realtime time and starts
at the oldest entry after it, the right place, but the gap is reported, never silent.

A dead child is restarted with exponential backoff from the last entry the caller received, which
(batches being handled before the next is requested) is the last entry handled.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
import warnings
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from ..errors import JournalError
from ..model import JournalEntry
from ..util.retry import Backoff
from .export import OUTPUT_FIELDS, ExportDecoder, ExportParser, LineParser

log = structlog.get_logger(__name__)

# What asyncio reports for a child whose exit status it could not read (another reaped it).
EXIT_STATUS_LOST = 255

READ_SIZE = 1 << 20
TERMINATE_TIMEOUT_S = 5.0
# A child that failed this many times in a row without handing over an entry is not a passing
# hiccup (a rotation's SIGBUS): it is logged as an error, with its last complaint, each time.
FAILING_AFTER = 3
# The journalctl child catches up through matches on the units' fields up to this many units (the
# native child's MATCH_UNITS_MAX): past it, an index look-up per unit and field for each entry
# costs more than parsing every entry (see journal_reader.c).
MATCH_UNITS_MAX = 64
UNIT_FIELDS = ("_SYSTEMD_UNIT", "UNIT", "OBJECT_SYSTEMD_UNIT")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReaderSettings:
    """Everything that shapes the journalctl command line."""

    units: tuple[str, ...] = ()  # empty: every entry of the journal
    directory: Path | None = None  # journalctl -D; None: the system journal
    files: tuple[Path, ...] = ()  # journalctl --file
    journalctl: str = "journalctl"
    follow: bool = True
    start_at: str = "tail"  # with no cursor: "head" or "tail"
    on_bad_cursor: str | None = None  # after journalctl refused the cursor; None: start_at
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    max_line_chars: int = 16384
    source: str = "journalctl"  # the child: "journalctl", "native" or "auto" (native if built)
    # Following a busy journal, the native child reads at most once per this interval (a kick
    # reads at once): one batch per interval instead of one wake-up of both processes per line.
    # Each batch costs both processes ~0.3 ms whatever its size; 100 ms delays no decision,
    # since an exit reported by systemd's PropertiesChanged kicks the child (see UnitWatch).
    linger_ms: int = 100


SOURCES = ("auto", "native", "journalctl")
# The libsystemd reader program, linked by setup.py into this package's directory.
NATIVE_READER = Path(__file__).with_name("vllm-supervisor-journal-reader")


def native_available() -> bool:
    """Was the libsystemd reader built (and installed executable)?"""
    return os.access(NATIVE_READER, os.X_OK)


def resolve_source(source: str) -> str:
    """The child to run for a configured source: "native" only if it was built."""
    if source not in SOURCES:
        raise JournalError(f"unknown journal reader {source!r}; one of {', '.join(SOURCES)}")
    if source == "auto":
        return "native" if native_available() else "journalctl"
    if source == "native" and not native_available():
        raise JournalError(
            "journal reader 'native' is not built (needs libsystemd-dev at install time);"
            " use reader = 'journalctl' or 'auto'"
        )
    return source


def reader_argv(settings: ReaderSettings, cursor: str | None, *, last: bool = False) -> list[str]:
    """The child's command line; `last`: only the journal's last entry (any unit), then exit."""
    if resolve_source(settings.source) == "native":
        return native_argv(settings, cursor, last=last)
    if last:
        return [*journalctl_argv(settings, None), "--lines=1"]
    return journalctl_argv(settings, cursor)


def _refuses_cursor(line: str) -> bool:
    """journalctl's (and the native reader's) message for a cursor it cannot seek to; a usage
    line naming `--cursor` is not one."""
    return line.startswith("Failed to seek to cursor")


def native_argv(settings: ReaderSettings, cursor: str | None, *, last: bool = False) -> list[str]:
    """The libsystemd child's command line: the same start points as `journalctl_argv`.

    The units go to the child's stdin (`native_input`), not here: any number of them. They are
    matched through the journal's field index when reading once and while catching up, then on
    each entry's unit fields when following (as `export.about` does), for the reason it gives.
    """
    argv = [os.fspath(NATIVE_READER), "--lines"]
    argv += [f"--field={name.decode()}" for name in OUTPUT_FIELDS]
    # The parser cuts a message to max_line_chars * 4 bytes (and marks it cut); the child cuts
    # every value at a little more, so that the parser still sees the message was longer.
    argv.append(f"--data-threshold={settings.max_line_chars * 4 + 64}")
    if settings.directory is not None:
        argv.append(f"--directory={settings.directory}")
    argv += [f"--file={path}" for path in settings.files]
    if not last and settings.units:
        argv.append("--units-from-stdin")
    if last:
        return [*argv, "--start=last"]
    if settings.follow:
        argv += ["--follow", f"--linger-ms={settings.linger_ms}"]
    if cursor is not None:
        return [*argv, f"--cursor={cursor}"]
    return [*argv, f"--start={settings.start_at if settings.follow else 'head'}"]


def native_input(settings: ReaderSettings, *, last: bool = False) -> bytes:
    """What the libsystemd child reads first on its stdin: the units, one a line, and an empty
    line (its sync requests follow). Nothing when `native_argv` gave no --units-from-stdin."""
    if last or not settings.units:
        return b""
    return b"".join(unit.encode() + b"\n" for unit in settings.units) + b"\n"


def unit_matches(units: tuple[str, ...]) -> list[str]:
    """journalctl's match arguments for what `export.about` accepts: `FIELD=u1 FIELD=u2 ...` (one
    field's values are ORed) for each of the units' fields, the fields joined by `+` (OR).

    Not `--unit`, which also asks _PID=1 with UNIT= and _UID=0 with OBJECT_SYSTEMD_UNIT=: the
    parent trusts those fields only from such senders anyway (`export.decode`), and the
    catch-up must hand over exactly what following on the fields would."""
    argv: list[str] = []
    for field in UNIT_FIELDS:
        if argv:
            argv.append("+")
        argv += [f"{field}={unit}" for unit in units]
    return argv


def catch_up_argv(settings: ReaderSettings, cursor: str | None) -> list[str]:
    """journalctl reading once, from `cursor` (inclusive) or the head, the entries about the
    units through the journal's field index (the matches of `unit_matches`).

    Every field, not `--output-fields`: journalctl 252 spends ~1.7x the CPU per entry picking
    fields (a 5M-entry backlog's 51k matched entries: 1.3-1.5 s against 0.7-0.8 s), more than
    parsing the other fields costs here (~0.5 s for those entries either way)."""
    once = dataclasses.replace(settings, follow=False, units=())
    argv = [a for a in journalctl_argv(once, cursor) if not a.startswith("--output-fields=")]
    return [*argv, *unit_matches(settings.units)]


def journalctl_argv(settings: ReaderSettings, cursor: str | None) -> list[str]:
    """The journalctl command line for one run of the reader."""
    argv = [
        settings.journalctl,
        "--output=export",
        "--output-fields=" + b",".join(OUTPUT_FIELDS).decode(),
        "--no-pager",
        "--quiet",
    ]
    if settings.directory is not None:
        argv.append(f"--directory={settings.directory}")
    argv += [f"--file={path}" for path in settings.files]
    if not settings.follow:
        # When following, the units are matched in Python instead (see `export.about`).
        argv += [f"--unit={unit}" for unit in settings.units]
    if settings.follow:
        # Entries of earlier boots matter too (a saved directory, a reboot while halted).
        argv += ["--follow", "--boot=all"]
    if cursor is not None:
        argv.append(f"--cursor={cursor}")
        if settings.follow:
            # journalctl 252 with --follow shows only --lines (default 10) entries from the
            # cursor and the rest after the next write to the journal: a halted unit writes
            # nothing more, so its crash would wait forever. --no-tail prints all of them.
            argv.append("--no-tail")
    elif settings.follow and settings.start_at == "tail":
        argv.append("--lines=0")
    elif settings.follow:
        argv.append("--no-tail")
    return argv


class JournalctlReader:
    """Yields batches of entries from journalctl, restarting it when it dies."""

    def __init__(
        self,
        settings: ReaderSettings,
        *,
        cursor: str | None = None,
        inclusive: bool = False,
        on_restart: Callable[[str], None] | None = None,
        on_invalid: Callable[[int], None] | None = None,
        on_following: Callable[[bool], None] | None = None,
        on_gap: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self.cursor = cursor
        # A saved "last handled" cursor is skipped; a replay point is read again (inclusive).
        self._inclusive = inclusive
        self.following = asyncio.Event()  # set while a journalctl child runs
        self.restarts = 0
        self.failures = 0  # restarts in a row without an entry handed over
        self.last_error: str | None = None  # the last failed child's complaint
        self.cursor_rejected = False  # journalctl refused the saved cursor at least once
        # Entries of any unit parsed from journalctl children: what reading cost this process
        # (the native child matches the units itself and is not counted).
        self.parsed = 0
        self._argv: list[str] = []
        self._on_restart = on_restart or (lambda reason: None)
        self._on_following = on_following or (lambda is_following: None)
        self._on_invalid = on_invalid or (lambda count: None)
        self._on_gap = on_gap or (lambda: None)
        self._process: asyncio.subprocess.Process | None = None
        self._refilter = False  # follow_units() asked for a restart of the child
        self._pass_failed = False  # the last catch-up pass's child failed (see _matched_pass)
        self._caught_up = False  # the journalctl child's backlog was read (see _catch_up)
        # Sync requests to the native child (see `sync`): the last asked, the last answered.
        self._sync_asked = 0
        self._sync_answered = 0
        self._synced = asyncio.Event()  # replaced (after being set) at each answer

    async def batches(self, stop: asyncio.Event | None = None) -> AsyncIterator[list[JournalEntry]]:
        """Entries in journal order, in batches; ends at EOF when not following, or on `stop`."""
        stop = stop or asyncio.Event()
        retry = Backoff(
            self.settings.backoff_s, max(self.settings.backoff_s, self.settings.backoff_max_s)
        )
        self.failures = 0
        while not stop.is_set():
            received = 0
            async for batch in self._run_once(stop):
                received += len(batch)
                self.failures = 0
                yield batch
            if stop.is_set() or not self.settings.follow:
                return
            if self._refilter:
                self._refilter = False
                log.info("journal_reader_refiltered", units=list(self.settings.units))
                continue
            self.following.clear()
            self._on_following(False)
            self.restarts += 1
            reason = "exited" if received or self.cursor is None else "no_output"
            self._on_restart(reason)
            self.failures += 1
            backoff = retry.delay(self.failures)
            if self.failures >= FAILING_AFTER:
                log.error(
                    "journal_reader_failing",
                    failures=self.failures,
                    error=self.last_error or reason,
                    action=f"restarting it in {backoff:g} s; nothing is read or decided meanwhile",
                )
            else:
                log.warning("journal_reader_restarting", reason=reason, backoff_s=backoff)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), backoff)

    async def _run_once(self, stop: asyncio.Event) -> AsyncIterator[list[JournalEntry]]:
        use_pidfd_child_watcher()
        go_on, tail = await self._await_first_entry(stop)
        if not go_on:
            return
        if self.cursor is None and self.settings.follow and self.settings.start_at == "tail":
            await self._pin_tail(tail)  # following from now on: there is no backlog to catch up
        elif self._catches_up():
            # Once: after a failure the cursor is near the journal's end (the follower moves it
            # with every unit's entries), and a reload follows new units from now on.
            self._caught_up = True
            async for batch in self._catch_up(stop):
                yield batch
            if stop.is_set() or self._refilter:
                return
        argv = reader_argv(self.settings, self.cursor)
        self._argv = argv
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                # The native child takes sync requests on its stdin.
                stdin=asyncio.subprocess.PIPE if self.can_sync else asyncio.subprocess.DEVNULL,
                limit=READ_SIZE,  # buffer up to 2 MiB before pausing the pipe (default 128 KiB)
            )
        except OSError as exc:
            raise JournalError(f"cannot run {argv[0]!r}: {exc.strerror}") from exc
        if self.can_sync and process.stdin is not None:
            # Buffered by the transport and written as the child reads, however long.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError, RuntimeError):
                process.stdin.write(native_input(self.settings))
        self._process = process
        self._announce_following()
        stderr_task = asyncio.create_task(_drain_stderr(process))
        try:
            async for batch in self._read(process, stop):
                yield batch
        finally:
            await terminate(process)
            errors = await stderr_task
            self._process = None
        await self._after_exit(process.returncode, errors)

    async def _read(
        self, process: asyncio.subprocess.Process, stop: asyncio.Event
    ) -> AsyncIterator[list[JournalEntry]]:
        assert process.stdout is not None  # noqa: S101 - created with PIPE above
        decoder = self._decoder()
        # --cursor is inclusive: the saved entry comes first again, unless it is to be re-read.
        # Read once, --unit can legitimately start after it (the saved entry of another unit).
        expected = self.cursor if self.settings.follow or not self.settings.units else None
        inclusive, self._inclusive = self._inclusive, False
        # One waiter for `stop` per child, not one task per read: a stop ends the child, and
        # its end of file ends the loop.
        stopper = asyncio.create_task(_terminate_on(stop, process))
        try:
            while chunk := await process.stdout.read(READ_SIZE):
                invalid = decoder.invalid
                entries, first, last = decoder.feed(chunk)
                if decoder.invalid != invalid:
                    self._on_invalid(decoder.invalid - invalid)
                if isinstance(decoder, ExportDecoder):
                    self.parsed, decoder.parsed = self.parsed + decoder.parsed, 0
                if expected is not None and first is not None:
                    # `first` is the entry the cursor seek landed on (the native child reports
                    # it even when it is another unit's): the saved one, unless it was vacuumed.
                    landed = first.decode("ascii", "replace")
                    if landed != expected:
                        self._gap(expected, landed)
                    elif not inclusive and entries and entries[0].cursor == expected:
                        entries = entries[1:]
                    expected = None
                if last is not None:
                    # Entries of other units still move the checkpoint forward.
                    self.cursor = last.decode("ascii", "replace")
                if first is not None:
                    yield entries  # handled by the caller before the sync answer counts
                if isinstance(decoder, LineParser) and decoder.synced > self._sync_answered:
                    self._sync_answered = decoder.synced
                    synced, self._synced = self._synced, asyncio.Event()
                    synced.set()
        finally:
            stopper.cancel()

    def _announce_following(self) -> None:
        """A child reads the journal (a catch-up run, then the follower: said once)."""
        if not self.following.is_set():
            self.following.set()
            self._on_following(True)

    def _catches_up(self) -> bool:
        """Does the journalctl child read the backlog through matches before following?"""
        settings = self.settings
        return (
            not self._caught_up
            and settings.follow
            and 0 < len(settings.units) <= MATCH_UNITS_MAX
            and resolve_source(settings.source) == "journalctl"
        )

    async def _catch_up(self, stop: asyncio.Event) -> AsyncIterator[list[JournalEntry]]:
        """Read what is already in the journal about the units through journalctl's matches,
        which use the journal's field index: a backlog costs the units' share of it, where the
        follower (which cannot use them, see `export.about`) parses every entry in Python.

        As the native child does (`catch_up` in journal_reader.c): matched passes from the
        start, each from the last entry the one before handed over, until one finds nothing new
        after the journal's tail was pinned: every entry about the units up to that tail has
        been handed over, and following goes on after it (`self.cursor`). Entries come in
        journal order as they are read, so the oldest ended invocations are decided first. A
        pass that fails ends the catch-up: following then reads from the last entry handed over
        (and reports the failure if it is the journal's)."""
        self._announce_following()
        since = self.cursor
        if since is not None and not await self._check_landing(since):
            return
        drop = not self._inclusive  # a replay point is read again, a handled entry is not
        tail: str | None = None
        while not stop.is_set() and not self._refilter:
            read = 0
            async for batch in self._matched_pass(since, drop, stop):
                read += len(batch)
                yield batch
            if self._pass_failed or stop.is_set() or self._refilter:
                return
            if read:
                since, drop = self.cursor, True
            elif tail is not None:
                break  # nothing about the units came after `since` since the tail was pinned
            try:
                tail = await self._last_cursor()
            except TimeoutError:
                return  # following goes on from the last entry handed over
            if tail is None:
                return  # an empty journal: following starts at its head
        self._inclusive = False
        self.cursor = tail

    async def _matched_pass(
        self, since: str | None, drop: bool, stop: asyncio.Event
    ) -> AsyncIterator[list[JournalEntry]]:
        """One `catch_up_argv` child to its end; `drop`: not the entry at `since` again.
        `self._pass_failed` says whether it failed."""
        argv = catch_up_argv(self.settings, since)
        self._argv = argv
        self._pass_failed = True
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                stdin=asyncio.subprocess.DEVNULL,
                limit=READ_SIZE,
            )
        except OSError as exc:
            log.warning("journal_catch_up_failed", error=exc.strerror, argv=argv)
            return
        self._process = process
        stderr_task = asyncio.create_task(_drain_stderr(process))
        stopper = asyncio.create_task(_terminate_on(stop, process))
        decoder = ExportDecoder(self.settings.max_line_chars)
        try:
            assert process.stdout is not None  # noqa: S101 - created with PIPE above
            while chunk := await process.stdout.read(READ_SIZE):
                invalid = decoder.invalid
                entries, _, last = decoder.feed(chunk)
                if decoder.invalid != invalid:
                    self._on_invalid(decoder.invalid - invalid)
                self.parsed, decoder.parsed = self.parsed + decoder.parsed, 0
                if drop and entries:
                    drop = False
                    if entries[0].cursor == since:
                        entries = entries[1:]
                if last is not None:
                    self.cursor = last.decode("ascii", "replace")
                    yield entries
        finally:
            stopper.cancel()
            await terminate(process)
            errors = await stderr_task
            self._process = None
        if process.returncode == 0:
            self._pass_failed = False
        elif not stop.is_set() and not self._refilter:
            log.warning(
                "journal_catch_up_failed",
                returncode=process.returncode,
                error="; ".join(errors[-3:]),
                argv=argv,
                action="following from the last entry handed over, every entry parsed",
            )

    async def _check_landing(self, cursor: str) -> bool:
        """Is the saved entry still there? A matched pass cannot tell (it seeks to the first
        entry about the units after it): the first entry at `cursor`, any unit's, is read and
        compared, and a vacuumed one is reported as a gap. False when journalctl refused the
        cursor or failed: following reports that (`_after_exit`), without the catch-up."""
        once = dataclasses.replace(self.settings, follow=False, units=())
        process = await asyncio.create_subprocess_exec(
            *journalctl_argv(once, cursor),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            stdin=asyncio.subprocess.DEVNULL,
        )
        assert process.stdout is not None  # noqa: S101 - created with PIPE above
        parser = ExportParser()
        landed: bytes | None = None
        try:
            while landed is None and (chunk := await process.stdout.read(1 << 16)):
                if entries := parser.feed(chunk):
                    landed = entries[0].get(b"__CURSOR", b"")
        finally:
            await terminate(process)
        if landed is None:
            # Nothing at or after the cursor: the journal ends there, or journalctl refused it
            # (then following says so). Either way, catching up has nothing to read.
            return False
        if landed.decode("ascii", "replace") != cursor:
            self._gap(cursor, landed.decode("ascii", "replace"))
        return True

    async def _last_cursor(self) -> str | None:
        """The cursor of the journal's last entry, whatever its unit; None when it is empty.
        TimeoutError when journalctl did not answer in time."""
        cursor, _ = await self._tail()
        return cursor

    async def _tail(self) -> tuple[str | None, int | None]:
        """`_last_cursor`, and the exit status of the child that read it."""
        last_entry = dataclasses.replace(self.settings, follow=False, units=())
        argv = reader_argv(last_entry, None, last=True)
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            stdin=asyncio.subprocess.DEVNULL,
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), TERMINATE_TIMEOUT_S * 6)
        except TimeoutError:
            await terminate(process)
            raise
        _, _, cursor = self._decoder().feed(output)
        return (
            cursor.decode("ascii", "replace") if cursor is not None else None
        ), process.returncode

    def _decoder(self) -> LineParser | ExportDecoder:
        max_chars = self.settings.max_line_chars
        if resolve_source(self.settings.source) == "native":
            return LineParser(max_chars)  # the child matched the units already
        units = self.settings.units if self.settings.follow else ()
        return ExportDecoder(max_chars, frozenset(unit.encode() for unit in units))

    def _gap(self, saved: str, first: str) -> None:
        """The saved entry is gone: say so once, with how much journal time was skipped."""
        self._on_gap()
        saved_us, first_us = cursor_realtime_us(saved), cursor_realtime_us(first)
        log.warning(
            "journal_cursor_gap",
            cursor=saved,
            resumed_at=first,
            skipped_s=None if saved_us is None or first_us is None else (first_us - saved_us) / 1e6,
            error="the saved cursor's entry is no longer in the journal (vacuumed); resuming at "
            "the oldest entry after it, entries in between may be lost",
        )

    async def _await_first_entry(self, stop: asyncio.Event) -> tuple[bool, str | None]:
        """Before journalctl follows a journal from no cursor, wait until it holds an entry:
        (False, None) when `stop` came first, else (True, the tail's cursor when the first
        look found it at once, for `_pin_tail` to use rather than read again).

        journalctl 252 refuses to follow a directory without a journal file ("Data from the
        specified boot (+0) is not available"): journal-remote's before its first upload, say.
        That is no failure of the reader, so it is not restarted and counted as one: the
        journal is looked at every `backoff_s` instead, and what arrives first is all new."""
        if self.cursor is not None or not self.settings.follow:
            return True, None
        if resolve_source(self.settings.source) != "journalctl":
            return True, None  # the native child follows an empty journal as it is
        said = False
        while not stop.is_set():
            try:
                cursor, status = await self._tail()
            except TimeoutError:
                return True, None  # journalctl did not answer: following tells what is wrong
            if status != 0:
                return True, None  # not empty but unreadable: the follower fails, says why
            if cursor is not None and not said:
                return True, cursor
            if cursor is not None:
                self.settings = dataclasses.replace(self.settings, start_at="head")
                return True, None
            if not said:
                said = True
                self._announce_following()
                log.info("journal_empty", action="waiting for its first entry")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.settings.backoff_s)
        return False, None

    async def _pin_tail(self, tail: str | None = None) -> None:
        """Fix "the tail" now, as a cursor, before announcing that the journal is followed.

        `journalctl --follow --lines=0` finds the tail only once it has started, which can be
        long after the daemon said it was ready (a slow, sandboxed start): anything written in
        between was lost. Reading the last entry's cursor first makes the start point exact.
        An empty journal has no tail: then everything that arrives is new (`--no-tail`).
        `tail`: that cursor, when it was read a moment ago (`_await_first_entry`).
        """
        # The last entry of the whole journal, whatever its unit: that is where following starts.
        try:
            cursor = tail if tail is not None else await self._last_cursor()
        except TimeoutError:
            return
        if cursor is not None:
            self.cursor = cursor
        else:
            self.settings = dataclasses.replace(self.settings, start_at="head")
        log.info("journal_tail_pinned", cursor=self.cursor)

    async def _after_exit(self, returncode: int | None, errors: list[str]) -> None:
        if returncode in (0, None, -signal.SIGTERM):
            return
        if returncode == EXIT_STATUS_LOST and not errors:
            # asyncio's stand-in for an exit status someone else reaped ("exit status already
            # read: will report returncode 255", Python 3.11, seen under load): journalctl
            # exits 1 on its own errors, and says why on stderr; this one said nothing.
            log.info("journalctl_exit_status_lost", argv=self._argv)
            return
        message = "; ".join(errors[-3:]) or f"exit status {returncode}"
        self.last_error = message
        log.warning("journalctl_failed", returncode=returncode, error=message, argv=self._argv)
        if self.cursor is not None and any(_refuses_cursor(line) for line in errors):
            # A cursor of another journal (or a corrupt one) is refused by journalctl outright;
            # following from where the caller's policy says beats a crash loop of our own.
            log.warning(
                "journal_cursor_rejected",
                cursor=self.cursor,
                error=message,
                resume_at=self.settings.on_bad_cursor,
            )
            self.cursor = None
            self.cursor_rejected = True
            if self.settings.on_bad_cursor is not None:
                start_at = self.settings.on_bad_cursor
                self.settings = dataclasses.replace(self.settings, start_at=start_at)
        if not self.settings.follow:
            raise JournalError(f"journalctl failed: {message}")

    def describe(self) -> str:
        """Which reader runs: "native" (the C child) or "journalctl"."""
        return resolve_source(self.settings.source)

    def kick(self) -> int | None:
        """Have the native child read the journal now, not at journald's next change
        notification (coalesced by a timer of up to 250 ms on systemd 252): a sync request.

        Returns its number (see `sync`), or None when no native child runs to ask (journalctl
        takes no requests)."""
        process = self._process
        if process is None or process.returncode is not None or process.stdin is None:
            return None
        self._sync_asked += 1
        try:
            process.stdin.write(b"%d\n" % self._sync_asked)
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            return None  # the child is exiting; its restart reads from the cursor anyway
        return self._sync_asked

    def memory_bytes(self) -> int | None:
        """The resident memory of the running child (VmRSS in /proc), or None without one."""
        process = self._process
        if process is None or process.returncode is not None:
            return None
        return resident_bytes(process.pid)

    @property
    def can_sync(self) -> bool:
        """Does this reader's child take sync requests (the native one does)?"""
        return resolve_source(self.settings.source) == "native"

    async def sync(self, timeout_s: float) -> bool:
        """Wait until everything in the journal files before now has been read and handed to
        the caller (its batches handled). False without a native child, or after `timeout_s`."""
        number = self.kick()
        if number is None:
            return False
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._sync_answered < number:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._synced.wait(), remaining)
        return True

    def follow_units(self, units: tuple[str, ...]) -> None:
        """Follow another set of units from the next entry on (a reloaded config).

        The child is restarted from the cursor at once, without the backoff of a failure.
        """
        self.settings = dataclasses.replace(self.settings, units=units)
        self._refilter = True
        if self._process is not None and self._process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._process.terminate()

    async def aclose(self) -> None:
        """Stop the child if one runs."""
        if self._process is not None:
            await terminate(self._process)


def use_pidfd_child_watcher() -> None:
    """Reap our children through pidfds (the default from Python 3.12 on).

    Python 3.11's default ThreadedChildWatcher sometimes loses a fast-exiting child and reports
    "Unknown child process pid N, will report returncode 255" (seen here: 2 of 30 runs of
    `triage` on a journal directory), which made a clean journalctl exit look like a failure.
    """
    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return
    policy = asyncio.get_event_loop_policy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        loop = asyncio.get_running_loop()
        watcher = policy.get_child_watcher()
        if not isinstance(watcher, asyncio.PidfdChildWatcher):
            watcher = asyncio.PidfdChildWatcher()
            policy.set_child_watcher(watcher)
        if getattr(watcher, "_loop", None) is not loop:  # a new loop (asyncio.run, tests)
            watcher.attach_loop(loop)


def resident_bytes(pid: int) -> int | None:
    """A process's resident memory (VmRSS of /proc/PID/status), or None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            with contextlib.suppress(ValueError, IndexError):
                return int(line.split()[1]) * 1024
    return None  # a zombie has no VmRSS line


def cursor_realtime_us(cursor: str) -> int | None:
    """The wall-clock time (`t=`, microseconds) an entry's cursor carries, if readable."""
    for part in cursor.split(";"):
        if part.startswith("t="):
            with contextlib.suppress(ValueError):
                return int(part[2:], 16)
    return None


async def terminate(process: asyncio.subprocess.Process) -> None:
    """SIGTERM the child (only ours), then SIGKILL if it does not exit in time."""
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.terminate()
    try:
        await asyncio.wait_for(process.wait(), TERMINATE_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()


async def _terminate_on(stop: asyncio.Event, process: asyncio.subprocess.Process) -> None:
    await stop.wait()
    with contextlib.suppress(ProcessLookupError):
        if process.returncode is None:
            process.terminate()


async def _drain_stderr(process: asyncio.subprocess.Process) -> list[str]:
    """Collect journalctl's complaints (bounded) so a failure can be explained."""
    lines: list[str] = []
    assert process.stderr is not None  # noqa: S101 - created with PIPE
    async for raw in process.stderr:
        lines.append(raw.decode("utf-8", "replace").rstrip())
        del lines[:-20]
    return lines


async def read_all(settings: ReaderSettings) -> AsyncIterator[list[JournalEntry]]:
    """Read a journal once (no follow), e.g. for `triage` of a saved directory."""
    reader = JournalctlReader(dataclasses.replace(settings, follow=False))
    async for batch in reader.batches():
        yield batch
