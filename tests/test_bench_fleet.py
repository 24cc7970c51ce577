"""`python -m bench.fleet` runs end to end on a small fleet (behaviour, not figures: the figures
of a hundred hosts come from running it by hand, bench/README.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_three_hosts_share_one_proof_and_an_outage_halts_none() -> None:
    ran = subprocess.run(
        [sys.executable, "-m", "bench.fleet", "--hosts", "3", "--group-wait", "1s",
         "--group-interval", "2s", "--format", "json"],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    result = json.loads(ran.stdout)
    assert result["hosts"] == 3
    # The first host proves it at its 2nd start; the third cannot miss the proof (the second
    # may race the first's 2nd crash).
    assert result["rollout"]["restarts_wasted"] <= 2
    assert result["rollout"]["rules"].get("fleet_proof", 0) >= 1
    assert result["rollout"]["hosts_halted"] == 3
    assert result["baseline_no_sharing"]["restarts_wasted"] == 3
    assert result["baseline_no_sharing"]["rules"].get("fleet_proof") is None
    assert result["outage"]["hosts_halted"] == 0
    told = result["notifications"]
    assert told["total"] <= 3 and max(told["alertmanager_hosts_named"]) == 3
    assert result["memory"]["daemon_rss_mb_median"] > 0
