"""Exit to quarantine under a real systemd 252: how long a fatal crash runs before it is halted.

`python -m bench.exit_latency [--crashes N]` boots the end-to-end tests' container
(tests/e2e/served.py: the shipped supervisor unit, gate drop-in and polkit rule, systemd 252 in
systemd-nspawn), makes the served unit print the seed flashinfer crash and exit 1 under
`Restart=always` with systemd's default `RestartSec=100ms`, and N times: starts it, waits for the
quarantine record, releases it. Each record must name the seed crash's signature: its root
cause is in the lines journald often writes after PID 1's end messages, so a decision made
before they were read would name another. Per crash: the quarantine file's mtime minus the
`__REALTIME_TIMESTAMP` of PID 1's "Main process exited" entry of the quarantined invocation
(both clocks are the host's: the container shares its kernel). Needs root and systemd-nspawn,
like `pytest -m nspawn`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.live import percentile

E2E = Path(__file__).resolve().parent.parent / "tests" / "e2e"
PROCESS_EXITED = "98e322203f7a4ed290d09fe03c09fe15"  # PID 1's "Main process exited"
SEED_SIGNATURE = "flashinfer_cubin_mismatch"  # its root cause is among the lines logged late


def _e2e_on_path() -> None:
    if str(E2E) not in sys.path:
        sys.path.insert(0, str(E2E))  # the e2e tests' container, reused as is


def unavailable() -> str | None:
    """Why systemd-nspawn cannot run here, or None when it can."""
    _e2e_on_path()
    from nspawn import preflight

    reason: str | None = preflight()
    return reason


def measure_exit_latency(crashes: int) -> dict[str, Any]:
    """Boot, crash `crashes` times, return the exit -> quarantine figures (milliseconds)."""
    _e2e_on_path()
    from nspawn import wait_for
    from served import (
        QUARANTINE,
        SEED_LOG,
        UNIT,
        deployed_container,
        halt_latency,
        install_served_unit,
        quarantined,
        settled,
        start_supervisor,
        unit_lines,
    )

    samples: list[float] = []
    signatures: list[str | None] = []  # each halt's verdict: the early decision saw the cause
    late_runs = 0  # crashes with lines journald wrote after PID 1's "Main process exited"
    with (
        tempfile.TemporaryDirectory(prefix="vllm-supervisor-exit-") as tmp,
        deployed_container(Path(tmp)) as box,
    ):
        install_served_unit(box, SEED_LOG, "100ms")
        start_supervisor(box)
        for _ in range(crashes):
            box.systemctl("start", "--no-block", UNIT)
            wait_for(lambda: quarantined(box), timeout=30, what="the quarantine record")
            wait_for(lambda: settled(box), timeout=30, what="the served unit to stay down")
            to_record, _ = halt_latency(box)
            samples.append(to_record * 1000)
            record = json.loads(box.run("cat", QUARANTINE).stdout)
            signatures.append(record.get("signature"))
            late_runs += _lines_after_exit(unit_lines(box), record.get("invocation_id")) > 0
            box.run("vllm-supervisor", "release", UNIT)
            wait_for(lambda: not quarantined(box), timeout=10, what="the release")
        # Whatever the daemon could not use (the bus watch, the stream probe) says why here.
        warnings = [
            entry.get("EVENT")
            for entry in box.journal("-u", "vllm-supervisor.service", "-p", "warning")
            if entry.get("EVENT")
        ]
    return {
        "supervisor_warnings": warnings,
        "crashes": len(samples),
        "signatures": sorted(set(map(str, signatures))),
        "halted_as_seed_crash": sum(s == SEED_SIGNATURE for s in signatures),
        "crashes_with_lines_after_the_exit": late_runs,
        "exit_to_quarantine_ms_p50": statistics.median(samples),
        "exit_to_quarantine_ms_p99": percentile(samples, 0.99),
        "exit_to_quarantine_ms_min": min(samples),
        "exit_to_quarantine_ms_max": max(samples),
        "samples_ms": [round(s, 1) for s in samples],
    }


def _lines_after_exit(entries: list[dict[str, str]], invocation_id: str | None) -> int:
    """How many of the invocation's own lines journald wrote after PID 1's exit entry."""
    exits = [
        int(e["__MONOTONIC_TIMESTAMP"])
        for e in entries
        if e.get("MESSAGE_ID") == PROCESS_EXITED and e.get("INVOCATION_ID") == invocation_id
    ]
    if not exits:
        return 0
    return sum(
        1
        for e in entries
        if e.get("_SYSTEMD_INVOCATION_ID") == invocation_id
        and e.get("_PID") != "1"
        and int(e["__MONOTONIC_TIMESTAMP"]) > exits[0]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.exit_latency", description=__doc__)
    parser.add_argument("--crashes", type=int, default=20)
    args = parser.parse_args(argv)
    result = measure_exit_latency(args.crashes)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
