"""Crash loops under a real systemd 252 with the shipped pacing schedule, for minutes.

`python -m bench.pacing [--minutes 5] [--format json]` boots the end-to-end tests' container
(tests/e2e/served.py: the shipped supervisor unit, gate drop-in and polkit rule, systemd 252 in
systemd-nspawn) with four units at once, each `Restart=always`, `RestartSec=1s`:
- `vllm-silent.service`: exits 1 after its start-up lines, no error line (supervised);
- `vllm-flaky.service`: the real hub's 429 at its first 3 starts, then serves (supervised);
- `vllm.service`: the seed's fatal flashinfer crash (supervised);
- `vllm-baseline.service`: the silent unit again, without the gate: systemd alone.
The supervisor's config sets no `pace_*` key: the shipped schedule (1 min doubling to 1 h).
It reports each unit's starts (PID 1's starts that ran the server, not those the gate skipped),
the gaps between them, when the flaky unit served after its first start, and the held starts'
timers systemd holds at the end. tests/e2e/test_pacing_e2e.py runs the same scenario with the
schedule scaled down, in a minute. Needs root and systemd-nspawn, like `pytest -m nspawn`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

E2E = Path(__file__).resolve().parent.parent / "tests" / "e2e"
BASELINE = "vllm-baseline.service"
FLAKY_SERVED_WITHIN_S = 300.0  # the bar: serving 5 minutes after its first start


def _e2e_on_path() -> None:
    if str(E2E) not in sys.path:
        sys.path.insert(0, str(E2E))  # the e2e tests' container and units, reused as they are


def run(minutes: float) -> dict[str, Any]:
    """Boot, start the four units, watch for `minutes`; the figures."""
    _e2e_on_path()
    from nspawn import wait_for
    from served import SEED_LOG, deployed_container, start_supervisor
    from test_pacing_e2e import FATAL, FLAKY, SILENT, UNIT_FILE, install, serving, starts

    config = "".join(f'[[unit]]\nname = "{u}"\n\n' for u in (SILENT, FLAKY, FATAL))
    config += '[metrics]\nlisten = "127.0.0.1:9464"\n'
    silent = "/opt/vsup/e2e/fake-server.sh /opt/vsup/e2e/silent-exit.log 1"
    with tempfile.TemporaryDirectory() as tmp, deployed_container(Path(tmp)) as box:
        install(box, SILENT, silent)
        flaky = "/opt/vsup/e2e/fake-flaky-server.sh /opt/vsup/e2e/hub-429.log /run/e2e-flaky 3"
        install(box, FLAKY, flaky)
        install(box, FATAL, f"/opt/vsup/e2e/fake-server.sh {SEED_LOG} 1")
        box.write_file(f"/etc/systemd/system/{BASELINE}", UNIT_FILE.format(command=silent))
        box.write_file(
            f"/etc/systemd/system/{BASELINE}.d/50-bench.conf", "[Service]\nRestartSec=1s\n"
        )
        box.systemctl("daemon-reload")
        start_supervisor(box, config)
        began = time.time()
        box.systemctl("start", "--no-block", SILENT, FLAKY, FATAL, BASELINE)
        served_at: float | None = None

        def watched() -> bool:
            nonlocal served_at
            if served_at is None and serving(box, FLAKY):
                served_at = time.time()
            return time.time() - began >= minutes * 60

        wait_for(watched, timeout=minutes * 60 + 30, what="the run", interval=1.0)
        timers = box.systemctl("list-timers", "--all", "--no-legend", "vllm-supervisor-hold-*")
        return {
            "minutes": minutes,
            "units": {
                unit: _starts(starts(box, unit), began) for unit in (SILENT, FLAKY, FATAL, BASELINE)
            },
            "flaky_served_after_s": None if served_at is None else round(served_at - began, 1),
            "flaky_served_within_bar": served_at is not None
            and served_at - began <= FLAKY_SERVED_WITHIN_S,
            "held_start_timers": [line.split()[-2] for line in timers.stdout.splitlines() if line],
        }


SHOWN = 12  # starts and gaps listed a unit (systemd alone makes hundreds)


def _starts(times: list[float], began: float) -> dict[str, Any]:
    gaps = [round(b - a, 1) for a, b in itertools.pairwise(times)]
    return {
        "starts": len(times),
        "at_s": [round(t - began, 1) for t in times[:SHOWN]],
        "gaps_s": gaps[:SHOWN],
        "longest_gap_s": max(gaps, default=0.0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pacing", description=__doc__)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--format", choices=("text", "json"), default="text")
    args = parser.parse_args(argv)
    _e2e_on_path()
    from nspawn import preflight

    reason = preflight()
    if reason is not None:
        print(f"bench.pacing: systemd-nspawn cannot run here: {reason}", file=sys.stderr)
        return 2
    figures = run(args.minutes)
    if args.format == "json":
        print(json.dumps(figures, indent=2))
        return 0
    print(f"{args.minutes:g} minutes, RestartSec=1s, the shipped schedule (1 min doubling to 1 h)")
    for unit, seen in figures["units"].items():
        print(f"  {unit}: {seen['starts']} starts at {seen['at_s']} s (gaps {seen['gaps_s']})")
    print(f"  the flaky unit served {figures['flaky_served_after_s']} s after its first start")
    print(f"  held starts' timers at the end: {figures['held_start_timers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
