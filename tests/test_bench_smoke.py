"""`python -m bench --quick` runs end to end and writes its JSON (behaviour only, no timing)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    shutil.which("journalctl") is None or not Path("/lib/systemd/systemd-journal-remote").exists(),
    reason="needs journalctl and systemd-journal-remote",
)


class TestBenchSmoke:
    def test_quick_run_writes_every_figure(self, tmp_path: Path) -> None:
        """A quick run measures every reader and the live daemon, and writes positive figures."""
        out = tmp_path / "latest.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bench",
                "--quick",
                "--entries",
                "5000",
                "--runs",
                "1",
                "--live-seconds",
                "1.5",
                "--cache",
                str(tmp_path / "cache"),
                "--out",
                str(out),
            ],
            cwd=REPO,
            check=True,
            capture_output=True,
            timeout=120,
        )
        result = json.loads(out.read_text())
        assert result["journal"]["unit_entries"] > 0
        ingest = result["ingest"]
        optional = {"python_systemd", "cysystemd"}  # the bench extra's peers, when installed
        assert set(ingest) - optional == {
            "supervisor",
            "supervisor_journalctl",
            "json",
            "export",
            "export_fields",
            "native",
        }
        for mode, figures in ingest.items():
            assert figures["entries_per_s"] > 0, mode
            assert figures["cpu_s_per_million"] > 0, mode
            if mode not in optional:  # a binding reads in process: no reader child
                assert figures["rss_journalctl_mb"] > 0, mode
            assert figures["speed_vs_baseline"] > 0
        assert ingest["json"]["speed_vs_baseline"] == pytest.approx(1.0)
        classification = ingest["supervisor"]["classification"]
        assert classification["crashed"] == result["journal"]["crashes"]
        assert classification["signatures"] == ["flashinfer_cubin_mismatch"]
        assert classification["classify_ms_max"] > 0
        live = {item["follower"]: item for item in result["live"]}
        assert {"supervisor", "journalctl_json"} <= set(live)
        for item in live.values():
            assert item["handled"] > 0
            assert item["cpu_percent"] > 0
        ours = live["supervisor"]
        assert ours["lag_ms_p99"] >= ours["lag_ms_p50"]
        assert ours["loop_lag_samples"] > 0
        idle = {item["follower"]: item for item in result["idle"]}
        assert set(idle) == set(live)
        assert idle["supervisor"]["rss_mb"] > 0
        assert idle["supervisor"]["wakeups_per_s"] >= 0
        assert result["batch_vs_child"] > 0
