"""What following the kernel's Xid lines costs the daemon: the same live run with and without.

`python -m bench.kernel_cost [--rounds 3] [--seconds 5] [--rate 2000]`: the live harness
(bench.live: the daemon as `app.run_daemon` builds it, following a journal journal-remote
writes) on an idle journal and at `--rate` lines/s, with the kernel's child off
(`BENCH_LIVE_KERNEL=0`, the baseline) and on, interleaved per round. Reported: medians of CPU %,
wake-ups per second, the crash latency and the children's memory, and on/off ratios of the
medians, measured in the same run (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from bench.live import measure_idle, measure_live

MODES = {"off": "0", "on": "1"}


def run(rounds: int, seconds: float, rate: int) -> dict[str, Any]:
    samples: dict[str, dict[str, list[float]]] = {m: {} for m in MODES}
    for _ in range(rounds):
        for mode, value in MODES.items():
            os.environ["BENCH_LIVE_KERNEL"] = value
            idle = measure_idle(seconds)
            live = measure_live(rate, seconds)
            got = samples[mode]
            for key, figure in (
                ("idle_wakeups_per_s", idle["wakeups_per_s"]),
                ("idle_child_rss_mb", idle["child_rss_mb"]),
                ("live_cpu_percent", live["cpu_percent"]),
                ("live_crash_ms_p50", live["crash_ms_p50"]),
                ("live_lag_ms_p50", live["lag_ms_p50"]),
            ):
                got.setdefault(key, []).append(float(figure))
    os.environ.pop("BENCH_LIVE_KERNEL", None)
    medians = {m: {k: statistics.median(v) for k, v in s.items()} for m, s in samples.items()}
    ratios = {
        key: (medians["on"][key] / medians["off"][key]) if medians["off"][key] else None
        for key in medians["off"]
    }
    return {
        "command": ["python", "-m", "bench.kernel_cost", *sys.argv[1:]],
        "rounds": rounds,
        "seconds": seconds,
        "rate": rate,
        "medians": medians,
        "ratio_on_to_off": ratios,
        "samples": samples,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernel_cost", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rate", type=int, default=2000)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.rounds, args.seconds, args.rate), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
