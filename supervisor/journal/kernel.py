"""The kernel's own lines about NVIDIA GPUs: a second, small source beside the units' reader.

A GPU's fault is written by the driver to the kernel's log (`NVRM: Xid (PCI:...): 79, ...`), not
to the unit's: the units' reader never sees it. This source reads the journal's kernel entries
through the journal's field index (`journalctl _TRANSPORT=kernel`: only the kernel's entries,
which are few), a pass every `POLL_S` and one at once for a crash that may be the GPU's, keeps
the driver's `NVRM:` lines and hands them on. Whichever child reads the units (the native
reader or journalctl), this one is journalctl: one match, no cursor (a restart reads the last
`LOOKBACK_S` again, which joins nothing twice: the join is by time).

Trusted only from the kernel: `_TRANSPORT=kernel` is journald's own field, and a line root wrote
to /dev/kmsg carries a facility of its own (the kernel forces LOG_USER on writes there), so
only facility 0 (kern) is kept. No client of the API and no unprivileged user can write one.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import structlog

from .export import ExportParser, Fields

log = structlog.get_logger(__name__)

KERNEL_FIELDS = (
    "MESSAGE",
    "_TRANSPORT",
    "SYSLOG_FACILITY",
    "_BOOT_ID",
    "_MACHINE_ID",
    "_HOSTNAME",
)
DRIVER_MARK = b"NVRM:"  # the NVIDIA driver's lines (its Xid lines, and their continuations)
LOOKBACK_S = 600.0  # at its start, what the kernel said this long ago is read too
POLL_S = 30.0  # how often the kernel's new lines are read (for counting; a crash reads at once)
READ_TIMEOUT_S = 60.0  # triage's one-shot read of a saved journal's kernel lines


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelLine:
    """One of the driver's lines, as the kernel logged it."""

    realtime_us: int
    boot_id: str | None
    host: str | None  # _MACHINE_ID
    hostname: str | None
    text: str


def kernel_argv(
    journalctl: str,
    *,
    directory: Path | None = None,
    files: Iterable[Path] = (),
    follow: bool,
    since_s: float | None = None,
    until_s: float | None = None,
) -> list[str]:
    """journalctl reading the journal's kernel entries, the fields the join needs."""
    argv = [
        journalctl,
        "--output=export",
        "--output-fields=" + ",".join(KERNEL_FIELDS),
        "--no-pager",
        "--quiet",
        "--boot=all",
    ]
    if directory is not None:
        argv.append(f"--directory={directory}")
    argv += [f"--file={path}" for path in files]
    if follow:
        argv += ["--follow", "--lines=all"]
    if since_s is not None:
        argv.append(f"--since=@{max(0, int(since_s))}")
    if until_s is not None:
        argv.append(f"--until=@{max(0, math.ceil(until_s))}")
    return [*argv, "_TRANSPORT=kernel"]


def driver_line(fields: Fields) -> KernelLine | None:
    """The entry as one of the driver's kernel lines, or None (another line, or not the
    kernel's own: another transport, or a facility the kernel does not log with)."""
    message = fields.get(b"MESSAGE")
    if message is None or DRIVER_MARK not in message:
        return None
    if fields.get(b"_TRANSPORT") != b"kernel":
        return None
    facility = fields.get(b"SYSLOG_FACILITY")
    if facility is not None and facility != b"0":
        return None  # root's write to /dev/kmsg, not the driver's
    try:
        realtime_us = int(fields.get(b"__REALTIME_TIMESTAMP") or b"")
    except ValueError:
        return None
    return KernelLine(
        realtime_us=realtime_us,
        boot_id=_text(fields.get(b"_BOOT_ID")),
        host=_text(fields.get(b"_MACHINE_ID")),
        hostname=_text(fields.get(b"_HOSTNAME")),
        text=message.decode("utf-8", "replace")[:4096],
    )


def read_driver_lines(
    journalctl: str,
    *,
    directory: Path | None = None,
    files: Iterable[Path] = (),
    since_s: float | None = None,
    until_s: float | None = None,
) -> list[KernelLine]:
    """The driver's kernel lines of a journal, between `since_s` and `until_s` when given
    (`triage`: all of a saved journal; the daemon: around one crash); [] when journalctl cannot
    read them (said: the verdict then rests on the unit's lines alone)."""
    argv = kernel_argv(
        journalctl,
        directory=directory,
        files=files,
        follow=False,
        since_s=since_s,
        until_s=until_s,
    )
    try:
        done = subprocess.run(argv, capture_output=True, timeout=READ_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("kernel_lines_unread", error=str(exc))
        return []
    parser = ExportParser()
    return [line for f in parser.feed(done.stdout + b"\n\n") if (line := driver_line(f))]


class KernelSource:
    """Reads the journal's kernel entries every `poll_s` and hands each new driver line to
    `on_line`.

    Not a following child: `journalctl -f` wakes on every write to the journal (2,000 lines/s
    of the units' cost it a third more CPU, bench.kernel_cost), while the kernel logs an Xid a
    few times a year. A crash that may be the GPU's reads the kernel's lines at once
    (supervisor.decide.xid_evidence); this pass is for counting every Xid, crash or not.
    """

    def __init__(
        self,
        on_line: Callable[[KernelLine], None],
        *,
        journalctl: str = "journalctl",
        directory: Path | None = None,
        files: Iterable[Path] = (),
        clock: Callable[[], float] = time.time,
        poll_s: float = POLL_S,
    ) -> None:
        self._on_line = on_line
        self._journalctl = journalctl
        self._directory = directory
        self._files = tuple(files)
        self._clock = clock
        self._poll_s = poll_s
        self._since = clock() - LOOKBACK_S
        self._seen: set[tuple[int, str]] = set()  # the last pass's lines (they overlap)

    async def run(self, stop: asyncio.Event) -> None:
        """Read the new kernel lines every `poll_s`, until `stop`."""
        while not stop.is_set():
            await self.read_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._poll_s)

    async def read_once(self) -> None:
        """One pass from the last line read (a second back: journald's order is by arrival)."""
        lines = await asyncio.to_thread(
            read_driver_lines,
            self._journalctl,
            directory=self._directory,
            files=self._files,
            since_s=self._since - 1,
        )
        seen = {(line.realtime_us, line.text) for line in lines}
        for line in lines:
            if (line.realtime_us, line.text) not in self._seen:
                self._on_line(line)
        self._seen = seen
        if lines:
            self._since = max(self._since, max(line.realtime_us for line in lines) / 1e6)


def _text(value: bytes | None) -> str | None:
    return value.decode("ascii", "replace") if value else None
