"""Journal entries for the trust tests: invocations as systemd 252 logs them, at chosen times."""

from __future__ import annotations

import time
from collections.abc import Sequence

from vllm_supervisor.journal.writer import (
    FieldValue,
    exit_entries,
    lifecycle,
    restart_entries,
    service_lines,
    start_entries,
    stop_job_entries,
)
from vllm_supervisor.model import LifecycleEvent

Entry = dict[str, FieldValue]
UNIT = "vllm.service"

SERVING = (
    "(APIServer pid={pid}) INFO:     Uvicorn running on http://0.0.0.0:8000 (Press CTRL+C to quit)"
)
FATAL_LINES = [
    "(EngineCore_DP0 pid={pid}) ERROR 11-30 10:01:09 [core.py:708] EngineCore failed to start.",
    "(EngineCore_DP0 pid={pid}) ERROR 11-30 10:01:09 [core.py:708] Traceback (most recent call"
    " last):",
    '(EngineCore_DP0 pid={pid}) ERROR 11-30 10:01:09 [core.py:708]   File "/opt/venv/lib/'
    'python3.12/site-packages/flashinfer/jit/env.py", line 76, in _get_cubin_dir',
    "(EngineCore_DP0 pid={pid}) ERROR 11-30 10:01:09 [core.py:708]     raise RuntimeError(",
    "(EngineCore_DP0 pid={pid}) ERROR 11-30 10:01:09 [core.py:708] RuntimeError: flashinfer-cubin"
    " version (0.6.3) does not match flashinfer version (0.6.4). Please install the same version"
    " of both packages.",
]
# One bad request while serving: uvicorn logs the exception and the server goes on. Its last
# line matches `vllm_config_invalid` (a ValueError raised under vllm/entrypoints/utils.py).
REQUEST_ERROR = [
    "(APIServer pid={pid}) ERROR:    Exception in ASGI application",
    "(APIServer pid={pid}) Traceback (most recent call last):",
    '(APIServer pid={pid})   File "/opt/venv/lib/python3.12/site-packages/vllm/entrypoints/'
    'utils.py", line 97, in wrapper',
    "(APIServer pid={pid})     return handler_task.result()",
    "(APIServer pid={pid}) ValueError: 'messages' must contain at least one message",
]


def us(seconds: float) -> int:
    """Seconds since the epoch as a journal timestamp."""
    return int(seconds * 1_000_000)


def ago(seconds: float) -> int:
    """The journal timestamp of `seconds` ago."""
    return us(time.time() - seconds)


def at(entries: list[Entry], when_us: int) -> list[Entry]:
    """The entries with the first one stamped `when_us` (journald's clock moves on from it)."""
    if entries:
        entries[0] = {**entries[0], "__REALTIME_TIMESTAMP": when_us}
    return entries


def lines(unit: str, invocation_id: str, texts: Sequence[str], pid: int) -> list[Entry]:
    """The server's own lines, `{pid}` filled in."""
    return list(service_lines(unit, invocation_id, [t.format(pid=pid) for t in texts], pid=pid))


def serving(unit: str, invocation_id: str, pid: int) -> list[Entry]:
    """A start that reached serving."""
    return start_entries(unit, invocation_id) + lines(unit, invocation_id, [SERVING], pid)


def fatal_crash(unit: str, invocation_id: str, pid: int, restarts: int | None = 1) -> list[Entry]:
    """A start that crashes at once on the flashinfer mismatch, then its restart scheduled."""
    entries = start_entries(unit, invocation_id) + lines(unit, invocation_id, FATAL_LINES, pid)
    entries += exit_entries(unit, invocation_id, 1)
    if restarts is not None:
        entries += restart_entries(unit, invocation_id, restarts)
    return entries


def stopped_by_a_person(unit: str, invocation_id: str, pid: int, status: int) -> list[Entry]:
    """`systemctl stop` of a running server that exits `status` on SIGTERM (143: trapped)."""
    entries = stop_job_entries(unit, invocation_id)
    entries += lines(
        unit, invocation_id, ["Terminated", "(APIServer pid={pid}) shutting down"], pid
    )
    entries += exit_entries(unit, invocation_id, status)
    entries.append(
        lifecycle(
            unit, invocation_id, LifecycleEvent.JOB_STOPPED, f"Stopped {unit}.",
            JOB_TYPE="stop", JOB_RESULT="done",
        )
    )  # fmt: skip
    return entries


def oom_killed(unit: str, invocation_id: str) -> list[Entry]:
    """The kernel's OOM killer ends the server (systemd 252's messages)."""
    return [
        lifecycle(
            unit, invocation_id, LifecycleEvent.OOM_KILLED,
            "A process of this unit has been killed by the OOM killer.",
        ),
        lifecycle(
            unit, invocation_id, LifecycleEvent.PROCESS_EXITED,
            "Main process exited, code=killed, status=9/KILL",
            EXIT_CODE="killed", EXIT_STATUS=9, COMMAND="ExecStart",
        ),
        lifecycle(
            unit, invocation_id, LifecycleEvent.UNIT_FAILED, "Failed with result 'oom-kill'.",
            UNIT_RESULT="oom-kill",
        ),
    ]  # fmt: skip


def suppressed(unit: str, dropped: int, next_invocation: str) -> Entry:
    """journald's late report of its rate limit, sent with the next invocation's first line."""
    return {
        "_PID": 21,
        "_UID": 0,
        "_SYSTEMD_UNIT": "systemd-journald.service",
        "_TRANSPORT": "driver",
        "PRIORITY": 5,
        "MESSAGE_ID": LifecycleEvent.SUPPRESSED.value,
        "MESSAGE": f"Suppressed {dropped} messages from {unit}",
        "N_DROPPED": dropped,
        "OBJECT_SYSTEMD_UNIT": unit,
        "OBJECT_SYSTEMD_INVOCATION_ID": next_invocation,
    }


def skipped_by_the_gate(unit: str, invocation_id: str, pid: int) -> list[Entry]:
    """A start the quarantine gate refused: the gate's own stderr, then systemd's skip."""
    entries = [
        lifecycle(unit, invocation_id, LifecycleEvent.STARTING, f"Starting {unit}...",
                  JOB_TYPE="start"),
    ]  # fmt: skip
    entries += lines(
        unit,
        invocation_id,
        [
            f"{unit}: start refused, quarantined: signature=flashinfer_cubin_mismatch; "
            "root_cause=RuntimeError: flashinfer-cubin version (0.6.3) does not match "
            "flashinfer version (0.6.4)",
            f"release it with: vllm-supervisor release {unit}",
        ],
        pid,
    )
    entries.append(
        lifecycle(
            unit, invocation_id, LifecycleEvent.CONDITION_SKIPPED,
            "Skipped due to 'exec-condition'.", UNIT_RESULT="exec-condition",
        )
    )  # fmt: skip
    return entries
