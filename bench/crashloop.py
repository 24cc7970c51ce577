"""A crash loop of one unit under `Restart=always`, written as systemd 252 journals it.

Per invocation, in journal order (the facts checked on systemd 252, docs/DESIGN.md §2 and §5):

    PID 1   Starting U...                      7d4958e8...  JOB_TYPE=start  (a new INVOCATION_ID)
    PID 1   Started U.                         39f53479...  JOB_TYPE=start JOB_RESULT=done
    U       the log's lines (stdout)                        _SYSTEMD_UNIT=U _SYSTEMD_INVOCATION_ID
    kernel  the driver's lines, if any, just before the exit  _TRANSPORT=kernel SYSLOG_FACILITY=0
    PID 1   U: Main process exited, code=exited, status=1/FAILURE
                                               98e32220...  EXIT_CODE=exited EXIT_STATUS=1
            (or the timing's ending: another status, none for status 0, `code=killed` for a signal)
    PID 1   U: Failed with result 'exit-code'. d9b373ed...  UNIT_RESULT=exit-code
    (all but the last invocation, RestartSec later)
    PID 1   U: Scheduled restart job, restart counter is at N.   5eb03494...  N_RESTARTS=N
    PID 1   Stopped U.                         9d1aaa27...  JOB_TYPE=restart JOB_RESULT=done

Every PID 1 message has `_PID=1`, `_UID=0`, `_SYSTEMD_UNIT=init.scope`, `UNIT=U` and the
INVOCATION_ID of the invocation it is about (the ended one for the exit, failure, restart and
stop; the new one for the start). The service's lines are spread over the invocation's run time,
as a model server's startup log is. Entries go through `supervisor.journal.writer.JournalWriter`
(systemd-journal-remote), so the result is a real journal directory that `journalctl -D` reads.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from vllm_supervisor.journal.writer import (
    EntryFactory,
    FieldValue,
    JournalWriter,
    exit_entries,
    restart_entries,
    service_lines,
    start_entries,
)
from vllm_supervisor.model import LifecycleEvent

# "Starting U..." (SD_MESSAGE_UNIT_STARTING).
STARTING = LifecycleEvent.STARTING.value
# A fixed start, so two runs write the same journal (ids are derived from the log's name too).
DEFAULT_START_US = int(datetime(2025, 8, 6, 20, 0, tzinfo=UTC).timestamp() * 1_000_000)
_NAMESPACE = uuid.UUID("5c1b0a52-0d5e-4a57-9a43-6f0c0d7d1e11")

_PID1: dict[str, FieldValue] = {
    "_UID": 0,
    "_GID": 0,
    "_COMM": "systemd",
    "_EXE": "/usr/lib/systemd/systemd",
    "_CMDLINE": "/sbin/init",
    "_SYSTEMD_CGROUP": "/init.scope",
    "_SYSTEMD_SLICE": "-.slice",
    "SYSLOG_FACILITY": 3,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopTiming:
    """How long each phase of one invocation takes (journal time)."""

    started_after_s: float = 0.05  # "Starting" to "Started" (Type=simple: right after the fork)
    lines_over_s: float = 60.0  # the log's lines are spread over this long
    exit_after_s: float = 0.5  # last line to "Main process exited"
    restart_sec: float = 10.0  # RestartSec=: "Failed" to "Scheduled restart job"
    # > 0: the server logs SERVING_LINE right after "Started" and serves this long before the
    # log's lines (a crash while serving); 0: the log's lines are its whole life (startup).
    served_for_s: float = 0.0
    # How the main process ended, as systemd records it: an exit status, or a signal (then
    # `exit_status` is ignored). A real journal's ending is replayed, not assumed: a kill from
    # outside reads differently from an exit of the program's own.
    exit_status: int = 1
    signal: int | None = None
    # The kernel's own lines (the driver's `NVRM:` records) logged this long before each exit,
    # a millisecond apart (`kernel_lines` of loop_entries).
    kernel_before_exit_s: float = 2.0


# systemd's names for the signals a main process is seen killed by ("status=9/KILL").
SIGNAL_NAMES = {1: "HUP", 2: "INT", 6: "ABRT", 7: "BUS", 9: "KILL", 11: "SEGV", 15: "TERM"}

# What uvicorn prints once vLLM's API server listens
# (supervisor.environment.serving.is_serving_line).
SERVING_LINE = "INFO:     Application startup complete."


@dataclass(frozen=True, slots=True, kw_only=True)
class CrashLoop:
    """What was written: the unit and its invocations, oldest first."""

    directory: Path
    unit: str
    invocation_ids: tuple[str, ...]
    entries: int


Timed = tuple[int, dict[str, FieldValue]]  # (realtime in us, fields)


def loop_entries(
    unit: str,
    lines: Sequence[str],
    *,
    name: str,
    invocations: int = 5,
    start_us: int = DEFAULT_START_US,
    timing: LoopTiming | None = None,
    kernel_lines: Sequence[str] = (),
) -> tuple[list[Timed], tuple[str, ...]]:
    """The entries of the whole loop with their timestamps, and the invocation ids.

    `kernel_lines` are the kernel's, not the unit's (a GPU's fault as the driver logs it):
    journald's kernel transport, written shortly before each invocation's exit."""
    timing = timing or LoopTiming()
    ids = tuple(uuid.uuid5(_NAMESPACE, f"{name}:{unit}:{i}").hex for i in range(invocations))
    out: list[Timed] = []
    now = start_us
    for index, invocation_id in enumerate(ids):
        now = _one_invocation(out, unit, invocation_id, lines, index, now, timing, kernel_lines)
        if index + 1 < len(ids):
            now += _us(timing.restart_sec)
            scheduled, stopped = restart_entries(unit, invocation_id, index + 1)
            out.append((now, _pid1(scheduled, 6)))
            now += 1_000
            # The restart job stops the unit, then starts it again under the same job id.
            out.append((now, _pid1(stopped, 6, JOB_ID=_job_id(index + 1))))
            now += 1_000
    return out, ids


def write_crash_loop(
    directory: Path,
    unit: str,
    lines: Sequence[str],
    *,
    name: str,
    invocations: int = 5,
    start_us: int = DEFAULT_START_US,
    timing: LoopTiming | None = None,
    kernel_lines: Sequence[str] = (),
) -> CrashLoop:
    """Write the loop into a fresh journal in `directory` with one journal-remote process."""
    entries, ids = loop_entries(
        unit,
        lines,
        name=name,
        invocations=invocations,
        start_us=start_us,
        timing=timing,
        kernel_lines=kernel_lines,
    )
    entries.sort(key=lambda timed: timed[0])  # the kernel's lines fall among the unit's
    seed = uuid.uuid5(_NAMESPACE, name)
    factory = EntryFactory(
        boot_id=uuid.uuid5(seed, "boot").hex,
        seqnum_id=uuid.uuid5(seed, "seqnum").hex,
        clock_us=start_us - 1,
    )
    with JournalWriter(directory, factory=factory) as writer:
        for at_us, fields in entries:
            # EntryFactory stamps `max(clock + 1, now)`: set the clock just before `at_us`.
            factory.clock_us = max(factory.clock_us, at_us - 1)
            writer.write([fields], flush=False)
        writer.write([], flush=True)
    return CrashLoop(directory=directory, unit=unit, invocation_ids=ids, entries=len(entries))


def _one_invocation(
    out: list[Timed],
    unit: str,
    invocation_id: str,
    lines: Sequence[str],
    index: int,
    now: int,
    timing: LoopTiming,
    kernel_lines: Sequence[str] = (),
) -> int:
    """Append one invocation, from "Starting" to "Failed"; return the time of "Failed"."""
    starting, started = start_entries(unit, invocation_id)
    out.append((now, _pid1(starting, 6, JOB_ID=_job_id(index))))
    now += _us(timing.started_after_s)
    out.append((now, _pid1(started, 6, JOB_ID=_job_id(index))))
    pid = 4242 + 1000 * index  # a new main process per start
    trusted = _service_trusted(unit, invocation_id, pid)
    if timing.served_for_s > 0:
        (serving,) = service_lines(unit, invocation_id, [SERVING_LINE], pid=pid)
        out.append((now + 1_000, {**serving, **trusted}))
        now += _us(timing.served_for_s)
    first = now
    step = _us(timing.lines_over_s) // max(len(lines), 1)
    for number, fields in enumerate(service_lines(unit, invocation_id, lines, pid=pid)):
        now = first + step * (number + 1)
        out.append((now, {**fields, **trusted}))
    now = max(now, first + _us(timing.lines_over_s)) + _us(timing.exit_after_s)
    at = now - _us(timing.kernel_before_exit_s)
    out.extend((at + 1_000 * n, kernel_entry(text)) for n, text in enumerate(kernel_lines))
    exited, failed = exit_entries(
        unit,
        invocation_id,
        timing.exit_status,
        signal=timing.signal,
        signal_name=SIGNAL_NAMES.get(timing.signal or 0, str(timing.signal)),
    )
    if timing.signal is not None or timing.exit_status != 0:
        # systemd 252 logs no "Main process exited" for a status-0 exit (DESIGN.md §5).
        out.append((now, _pid1(exited, 5)))
        now += 1_000
    out.append((now, _pid1(failed, 4)))
    return now


def kernel_entry(text: str) -> dict[str, FieldValue]:
    """A line as journald stores the kernel's: its own transport, the kern facility."""
    return {
        "MESSAGE": text,
        "_TRANSPORT": "kernel",
        "SYSLOG_FACILITY": 0,
        "SYSLOG_IDENTIFIER": "kernel",
        "PRIORITY": 3,
    }


def _pid1(
    entry: dict[str, FieldValue], priority: int, **fields: FieldValue
) -> dict[str, FieldValue]:
    """One of writer's PID 1 messages with the rest of PID 1's trusted fields, its priority
    and (for job messages) the job id."""
    return {**entry, **_PID1, "PRIORITY": priority, **fields}


def _service_trusted(unit: str, invocation_id: str, pid: int) -> dict[str, FieldValue]:
    """The trusted fields journald adds to a service's stdout besides writer.service_lines'."""
    return {
        "_UID": 998,
        "_GID": 998,
        "_COMM": "python3",
        "_SYSTEMD_CGROUP": f"/system.slice/{unit}",
        "_SYSTEMD_SLICE": "system.slice",
        "_STREAM_ID": uuid.uuid5(_NAMESPACE, f"{invocation_id}:{pid}").hex,
        "SYSLOG_FACILITY": 3,
    }


def _job_id(index: int) -> int:
    return 1000 + index


def _us(seconds: float) -> int:
    return int(seconds * 1_000_000)
