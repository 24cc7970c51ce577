"""Writes real journal files without a running systemd, through systemd-journal-remote.

journal-remote reads journal export format on stdin and appends to a journal file that the real
`journalctl -D DIR` reads (and follows live). The demo, the tests and the benchmark use this to
produce genuine journal files instead of imitations.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
import subprocess
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from ..errors import JournalError
from ..model import LifecycleEvent

JOURNAL_REMOTE = "/lib/systemd/systemd-journal-remote"
FieldValue = str | bytes | int
# The header of a journal file (systemd's journal-def.h): seqnum_id at byte 72, head_entry_seqnum
# at 168 and head_entry_realtime at 184; `state` at 16 (2 = archived).
_HEADER = struct.Struct("<72x16s80xQ8xQ")
_STATE_OFFSET = 16
_STATE_ARCHIVED = 2


def export_entry(fields: Mapping[str, FieldValue]) -> bytes:
    """One entry in journal export format; values that are not plain text go binary."""
    out = bytearray()
    for key, value in fields.items():
        raw = value if isinstance(value, bytes) else str(value).encode()
        if b"\n" in raw or not _printable(raw):
            out += key.encode() + b"\n" + len(raw).to_bytes(8, "little") + raw + b"\n"
        else:
            out += key.encode() + b"=" + raw + b"\n"
    return bytes(out + b"\n")


def _printable(raw: bytes) -> bool:
    return all(b >= 0x20 or b == 0x09 for b in raw)


def local_machine_id() -> str:
    """This machine's id (/etc/machine-id), as journald writes it into _MACHINE_ID."""
    try:
        return Path("/etc/machine-id").read_text(encoding="ascii").strip()
    except OSError:
        return ""


def local_boot_id() -> str:
    """The running kernel's boot id, as journald writes it into _BOOT_ID (no dashes)."""
    try:
        text = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii")
    except OSError:
        return ""
    return text.strip().replace("-", "")


@dataclass(slots=True)
class EntryFactory:
    """Adds the trusted fields journald would add: cursor, timestamps, boot, machine, host.

    By default the entries are this machine's, of the running boot, as journald would write
    them here; a test of another host or an earlier boot names its own. An entry's fields may
    override any of them (e.g. `_BOOT_ID` of an earlier boot).
    """

    boot_id: str = field(default_factory=local_boot_id)
    machine_id: str = field(default_factory=local_machine_id)
    hostname: str = field(default_factory=socket.gethostname)
    seqnum_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    clock_us: int = field(default_factory=lambda: int(time.time() * 1e6))
    monotonic_us: int = 0
    seqnum: int = 0

    def entry(self, fields: Mapping[str, FieldValue], *, now_us: int | None = None) -> bytes:
        """Export bytes for one entry with journald's trusted fields filled in.

        `now_us` (or the entry's own `__REALTIME_TIMESTAMP`) moves the clock forward; it never
        goes back, as journald's does not within one file. The monotonic clock moves as much,
        unless the entry gives its own `__MONOTONIC_TIMESTAMP` (a wall clock that stepped).
        """
        self.seqnum += 1
        stamp = fields.get("__REALTIME_TIMESTAMP")
        wanted = now_us if now_us is not None else int(stamp) if stamp is not None else 0
        before = self.clock_us
        self.clock_us = max(self.clock_us + 1, wanted)
        monotonic = fields.get("__MONOTONIC_TIMESTAMP")
        if monotonic is not None:
            self.monotonic_us = max(self.monotonic_us + 1, int(monotonic))
        else:
            self.monotonic_us += self.clock_us - before
        boot = str(fields.get("_BOOT_ID", self.boot_id))
        head: dict[str, FieldValue] = {
            "__CURSOR": f"s={self.seqnum_id};i={self.seqnum:x};b={boot};"
            f"m={self.monotonic_us:x};t={self.clock_us:x};x=0",
            "__REALTIME_TIMESTAMP": self.clock_us,
            "__MONOTONIC_TIMESTAMP": self.monotonic_us,
            "_BOOT_ID": boot,
            "_MACHINE_ID": self.machine_id,
            "_HOSTNAME": self.hostname,
        }
        # An entry may name another boot, machine or host (a test of a reboot, of a directory
        # holding two hosts); the cursor and the timestamps stay the factory's.
        fixed = ("__CURSOR", "__REALTIME_TIMESTAMP", "__MONOTONIC_TIMESTAMP")
        return export_entry({**head, **{k: v for k, v in fields.items() if k not in fixed}})


class JournalWriter:
    """A running systemd-journal-remote appending entries to `directory/remote.journal`."""

    def __init__(self, directory: Path, *, factory: EntryFactory | None = None) -> None:
        binary = shutil.which(JOURNAL_REMOTE) or shutil.which("systemd-journal-remote")
        if binary is None:
            raise JournalError(
                f"{JOURNAL_REMOTE} not found: install the Debian package systemd-journal-remote"
            )
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.factory = factory or EntryFactory()
        self._binary = binary
        self._process = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [self._binary, f"--output={self.directory / 'remote.journal'}", "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    @property
    def pid(self) -> int:
        """The journal-remote process (killed only by this writer)."""
        return self._process.pid

    def write(self, entries: Iterable[Mapping[str, FieldValue]], *, flush: bool = True) -> None:
        """Append entries; with `flush` they are handed to journal-remote at once."""
        assert self._process.stdin is not None  # noqa: S101 - created with PIPE
        for fields in entries:
            self._process.stdin.write(self.factory.entry(fields))
        if flush:
            self._process.stdin.flush()

    def nudge(self) -> None:
        """Wake followers, as journald does after each write (journal_file_post_change).

        journal-remote coalesces these wake-ups, and `journalctl --follow` only reads on an
        inotify event, so entries can sit unseen until the next write. Touching the file's times
        is an inotify event libsystemd's directory watch reads as a change (IN_ATTRIB). Not
        journald's own ftruncate to the file's size: with journal-remote appending between the
        size read and the truncate, that cut its fresh entry off and killed it with SIGBUS.
        """
        path = self.directory / "remote.journal"
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)

    def rotate(self) -> Path:
        """Archive the active file under journald's name for it and go on in a fresh one.

        journald rotates by renaming the file to `<name>@<seqnum id>-<head seqnum>-<head
        realtime>.journal` (the name `journalctl --vacuum-*` recognises) and opening a new one;
        here journal-remote finishes the file, it is renamed and marked archived, and a new
        journal-remote starts. The entry factory carries on, so the clocks never go back.
        """
        self.close()
        active = self.directory / "remote.journal"
        with active.open("r+b") as journal:
            header = journal.read(_HEADER.size)
            seqnum_id, head_seqnum, head_realtime = _HEADER.unpack(header)
            journal.seek(_STATE_OFFSET)
            journal.write(bytes([_STATE_ARCHIVED]))
        name = f"remote@{seqnum_id.hex()}-{head_seqnum:016x}-{head_realtime:016x}.journal"
        archived = self.directory / name
        active.rename(archived)
        self._process = self._start()
        # journal-remote creates its file as it starts: wait, so a vacuum right after counts it.
        deadline = time.monotonic() + 10
        while not active.exists() and self._process.poll() is None:
            if time.monotonic() > deadline:
                raise JournalError(f"journal-remote created no {active}")
            time.sleep(0.005)
        return archived

    def close(self) -> None:
        """Finish the file: journal-remote writes everything and exits on EOF."""
        if self._process.stdin is not None and not self._process.stdin.closed:
            self._process.stdin.close()
        returncode = self._process.wait(timeout=60)
        stderr = self._process.stderr.read() if self._process.stderr is not None else b""
        if returncode != 0:
            raise JournalError(f"journal-remote failed: {stderr.decode(errors='replace')[-500:]}")

    def __enter__(self) -> JournalWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def vacuum_files(directory: Path, keep_files: int, *, journalctl: str = "journalctl") -> list[str]:
    """`journalctl --vacuum-files`, as an operator would run it: the names of the files deleted."""
    result = subprocess.run(
        [journalctl, f"--directory={directory}", f"--vacuum-files={keep_files}"],
        capture_output=True,
        check=True,
        text=True,
        timeout=60,
    )
    # Each deletion is one line: "Deleted archived journal PATH (SIZE)."
    deleted = (line for line in result.stderr.splitlines() if line.startswith("Deleted"))
    return [Path(line.split()[3]).name for line in deleted]


def service_lines(
    unit: str, invocation_id: str, lines: Sequence[str], *, pid: int = 4242
) -> Iterator[dict[str, FieldValue]]:
    """Entries for lines a service printed (as journald stores stdout of a unit)."""
    for line in lines:
        yield {
            "_SYSTEMD_UNIT": unit,
            "_SYSTEMD_INVOCATION_ID": invocation_id,
            "_PID": pid,
            "PRIORITY": 6,
            "SYSLOG_IDENTIFIER": unit.split(".")[0],
            "_TRANSPORT": "stdout",
            "MESSAGE": line,
        }


def lifecycle(
    unit: str, invocation_id: str, event: LifecycleEvent, message: str, **fields: FieldValue
) -> dict[str, FieldValue]:
    """One of PID 1's messages about a unit, as systemd 252 writes it."""
    return {
        "_PID": 1,
        "_UID": 0,
        "_SYSTEMD_UNIT": "init.scope",
        "SYSLOG_IDENTIFIER": "systemd",
        "_TRANSPORT": "journal",
        "PRIORITY": 6,
        "UNIT": unit,
        "INVOCATION_ID": invocation_id,
        "MESSAGE_ID": event.value,
        "MESSAGE": message if message.startswith(_BARE_MESSAGES) else f"{unit}: {message}",
        **fields,
    }


# PID 1 writes these without the "unit: " prefix (systemd 252).
_BARE_MESSAGES = ("Started", "Stopped", "Starting", "Stopping")


def start_entries(unit: str, invocation_id: str) -> list[dict[str, FieldValue]]:
    """A start job as systemd 252 logs it: "Starting U..." then "Started U." (new id on both)."""
    return [
        lifecycle(unit, invocation_id, LifecycleEvent.STARTING, f"Starting {unit}...",
                  JOB_TYPE="start"),
        lifecycle(unit, invocation_id, LifecycleEvent.JOB_STARTED, f"Started {unit}.",
                  JOB_TYPE="start", JOB_RESULT="done"),
    ]  # fmt: skip


def exit_entries(
    unit: str,
    invocation_id: str,
    exit_status: int,
    *,
    signal: int | None = None,
    signal_name: str = "TERM",
) -> list[dict[str, FieldValue]]:
    """The main process's exit and the unit's end, as systemd 252 logs them.

    Status 0 ends "Deactivated successfully", any other "Failed with result 'exit-code'"; with
    `signal` the process was killed by that signal ("Failed with result 'signal'").
    """
    if signal is not None:
        exited = lifecycle(
            unit, invocation_id, LifecycleEvent.PROCESS_EXITED,
            f"Main process exited, code=killed, status={signal}/{signal_name}",
            EXIT_CODE="killed", EXIT_STATUS=signal, COMMAND="ExecStart",
        )  # fmt: skip
        result = "signal"
    else:
        status = "SUCCESS" if exit_status == 0 else "FAILURE"
        exited = lifecycle(
            unit, invocation_id, LifecycleEvent.PROCESS_EXITED,
            f"Main process exited, code=exited, status={exit_status}/{status}",
            EXIT_CODE="exited", EXIT_STATUS=exit_status, COMMAND="ExecStart",
        )  # fmt: skip
        result = "exit-code"
    if exit_status == 0 and signal is None:
        end = lifecycle(
            unit, invocation_id, LifecycleEvent.DEACTIVATED, "Deactivated successfully."
        )
    else:
        end = lifecycle(
            unit, invocation_id, LifecycleEvent.UNIT_FAILED,
            f"Failed with result '{result}'.", UNIT_RESULT=result,
        )  # fmt: skip
    return [exited, end]


def restart_entries(unit: str, invocation_id: str, restarts: int) -> list[dict[str, FieldValue]]:
    """systemd scheduling the automatic restart of an ended invocation (after RestartSec=)."""
    return [
        lifecycle(unit, invocation_id, LifecycleEvent.RESTART_SCHEDULED,
                  f"Scheduled restart job, restart counter is at {restarts}.",
                  N_RESTARTS=restarts),
        lifecycle(unit, invocation_id, LifecycleEvent.JOB_STOPPED, f"Stopped {unit}.",
                  JOB_TYPE="restart", JOB_RESULT="done"),
    ]  # fmt: skip


def stop_job_entries(unit: str, invocation_id: str) -> list[dict[str, FieldValue]]:
    """The start of a stop job on a running unit (`systemctl stop` or `restart`)."""
    return [
        lifecycle(unit, invocation_id, LifecycleEvent.STOPPING, f"Stopping {unit}...",
                  JOB_TYPE="stop"),
    ]  # fmt: skip


def crashed_invocation(
    unit: str,
    lines: Sequence[str],
    *,
    exit_status: int = 1,
    restarts: int | None = None,
    invocation_id: str | None = None,
    pid: int = 4242,
) -> list[dict[str, FieldValue]]:
    """A whole invocation that crashes, as systemd 252 logs it under `Restart=always`.

    "Starting", "Started", its lines, the exit and the failure, then (with `restarts`) the
    restart scheduled with that counter and the restart job's "Stopped".
    """
    inv = invocation_id or uuid.uuid4().hex
    entries = start_entries(unit, inv)
    entries += service_lines(unit, inv, lines, pid=pid)
    killed = exit_status - 128 if exit_status >= 128 else None
    entries += exit_entries(unit, inv, exit_status, signal=killed)
    if restarts is not None:
        entries += restart_entries(unit, inv, restarts)
    return entries
