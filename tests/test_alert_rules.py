"""The shipped Prometheus alerting rules load and behave as their promtool unit tests say."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES_DIR = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(
        shutil.which("promtool") is None, reason="needs promtool (Debian prometheus)"
    ),
]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["promtool", *args], cwd=RULES_DIR, capture_output=True, text=True, check=False, timeout=120
    )


def test_rules_are_valid() -> None:
    """promtool check rules accepts alerts.yml."""
    result = _promtool("check", "rules", "alerts.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rule_unit_tests_pass() -> None:
    """promtool test rules passes every case of alerts_test.yml."""
    result = _promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_tested() -> None:
    """Each alert in alerts.yml has at least one case in alerts_test.yml."""
    rules = (RULES_DIR / "alerts.yml").read_text(encoding="utf-8")
    tests = (RULES_DIR / "alerts_test.yml").read_text(encoding="utf-8")
    names = [line.split(":", 1)[1].strip() for line in rules.splitlines() if "- alert:" in line]
    assert names
    assert [n for n in names if f"alertname: {n}" not in tests] == []
