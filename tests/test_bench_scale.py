"""`python -m bench.scale --quick` runs every section end to end and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_quick_run_measures_every_section(tmp_path: Path) -> None:
    """Every configured crash is decided, no reader restarts, and each figure is positive."""
    label = f"smoke-{tmp_path.name}"
    subprocess.run(
        [sys.executable, "-m", "bench.scale", "--quick", "--cache", str(tmp_path / "cache"),
         "--label", label],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=600,
    )  # fmt: skip
    out = REPO / "bench" / "results" / f"scale-{label}.json"
    try:
        result = json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)
    for row in result["units"]["rows"].values():
        assert row["decided"] == row["crashes"] > 0
        assert row["reader_restarts"] == 0
        assert row["rss_anon_mb"] > 0
        assert row["others"]["daemon_journalctl"]["decided"] == row["crashes"]
        assert row["others"]["journalctl_u"]["caught_up_s"] > 0
    (size,) = result["backlog"].values()
    backlog = size["rows"]
    assert backlog["daemon"]["decided"] == backlog["daemon_journalctl"]["decided"] == 5
    assert backlog["journalctl_u"]["wall_s"] > 0 and backlog["child"]["wall_s"] > 0
    assert backlog["daemon_journalctl"]["vs_journalctl_u"] > 0
    assert all(row["rss_anon_mb"] > 0 for row in result["lines"]["rows"].values())
    assert all(row["us_per_line"] > 0 for row in result["tracker"]["rows"].values())
    tables = result["table"]["rows"]
    shipped = sum(
        len(tomllib.loads(path.read_text())["signature"])
        for path in (REPO / "config" / "signatures").glob("*.toml")
    )
    # "135" asks for the shipped table, however many signatures it has grown to.
    assert [row["signatures"] for row in tables.values()] == [shipped, 1000]
    assert {row["runs"][0]["signature"] for row in tables.values()} == {"flashinfer_cubin_mismatch"}
