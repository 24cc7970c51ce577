"""`python -m bench.lineparse` runs end to end against another checkout (behaviour only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_it_compares_two_checkouts_and_writes_every_measure(tmp_path: Path) -> None:
    """This checkout against itself as `--code`: each measure positive, its ratio near 1."""
    out = tmp_path / "lineparse.json"
    argv = [sys.executable, "-m", "bench.lineparse", "--code", str(REPO), "--runs", "1"]
    subprocess.run([*argv, "--lines", "2000", "--json", str(out)], check=True, cwd=REPO)
    report = json.loads(out.read_text(encoding="utf-8"))
    for measure in ("parse_lines", "parse_line", "is_serving_line"):
        assert report["this"][measure] > 0
        assert report["baseline"][measure] > 0
        assert 0 < report["ratio"][measure] < 10
