"""The shipped Prometheus alerting rules load and behave as their promtool unit tests say."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from vllm_supervisor.telemetry.metrics import Metrics, new_registry

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


DASHBOARD = RULES_DIR.parent / "grafana" / "vllm-supervisor.json"
GRAFANA_VARS = {"$instance": ".*", "$unit": ".*", "$__rate_interval": "5m", "$__range": "1h"}


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"]]
    for name, value in GRAFANA_VARS.items():
        exprs = [e.replace(name, value) for e in exprs]
    return exprs


def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Every PromQL query of the Grafana dashboard parses (as recording rules for promtool)."""
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query{i}", "expr": e}
                    for i, e in enumerate(_dashboard_queries())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(json.dumps(rules), encoding="utf-8")  # JSON is valid YAML
    result = _promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_uses_only_exported_metrics() -> None:
    """The dashboard queries name only series the supervisor exports (or `up`)."""
    metrics = Metrics(new_registry(process=False))
    metrics.register_units(["vllm.service"])
    exported = {
        line.split(" ")[2]
        for line in metrics.exposition()[0].decode().splitlines()
        if line.startswith("# TYPE")
    }
    names = set(re.findall(r"vllm_supervisor_[a-z_]+", " ".join(_dashboard_queries())))
    known = exported | {f"{n}_bucket" for n in exported}
    assert sorted(names - known) == []
