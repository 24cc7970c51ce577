"""The compressed soak (bench/soak.py) at CI scale: every line and crash handled, memory flat."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SECONDS, RATE, CRASH_EVERY = 75, 5000, 3
# Between the medians of the second and the last quarter of the run (~37 s apart, ~190k lines):
# the allocator, SQLite's page cache (2 MB at most) and the metrics settle within ~1 MB here
# after the first quarter, while a leak of one small object per line (>= 30 bytes) would add
# more than 5 MB, and one kept invocation per crash (hundreds of lines) more again.
RSS_GROWTH_MB = 5.0


@pytest.mark.soak
class TestSoak:
    """Minutes of traffic at 5k lines/s with a crash every few seconds."""

    def test_soak_loses_nothing_and_memory_stays_flat(self, tmp_path: Path) -> None:
        """Every line read, every crash classified, RSS flat, no error logged."""
        out = tmp_path / "soak.json"
        argv = [
            sys.executable,
            "-m",
            "bench.soak",
            f"--seconds={SECONDS}",
            f"--rate={RATE}",
            f"--crash-every={CRASH_EVERY}",
            "--keep-files=1",
            f"--out={out}",
        ]
        run = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=280)
        assert run.returncode in (0, 1), run.stderr[-3000:]
        figures = json.loads(out.read_text())
        print(run.stdout)
        assert figures["crashes_written"] >= SECONDS // CRASH_EVERY - 1
        assert figures["crashes_written"] == figures["crashes_classified"]
        assert figures["severities_expected"] == figures["severities_classified"]
        assert figures["lines_written"] == figures["lines_handled"]
        assert figures["errors"] == []
        assert figures["tracebacks"] == 0
        assert figures["daemon_exit_status"] == 0
        # journal-remote rotated its file under the follower, and the old one was vacuumed.
        assert figures["rotations"] >= 1
        assert figures["files_vacuumed"] >= 1
        assert [w for w in figures["warnings"] if w["event"] == "journal_cursor_gap"] == []
        growth = figures["rss_mb_q4_median"] - figures["rss_mb_q2_median"]
        assert growth < RSS_GROWTH_MB, figures["rss_samples"]
