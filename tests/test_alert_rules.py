"""The shipped Prometheus alerting rules load and behave as their promtool unit tests say."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from vllm_supervisor.model import Rule
from vllm_supervisor.notify.alertmanager import RUNBOOK_URL, alert
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

ROOT = Path(__file__).resolve().parent.parent
RULES_DIR = ROOT / "deploy" / "prometheus"
SEVERITIES = {"critical", "warning", "info"}  # what routes conventionally match on

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


def _rules() -> dict[str, str]:
    """Each alert's name and the text of its rule (alerts.yml, one `- alert:` item each)."""
    text = (RULES_DIR / "alerts.yml").read_text(encoding="utf-8")
    items = re.split(r"^      - alert: ", text, flags=re.MULTILINE)[1:]
    return {item.split("\n", 1)[0].strip(): item for item in items}


def _github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file."""
    anchors = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_every_alert_has_a_conventional_severity_and_a_runbook() -> None:
    """Each alert's severity is one a route matches on (critical, warning, info), and its
    runbook_url is a section of README.md that exists."""
    anchors = _github_anchors((ROOT / "README.md").read_text(encoding="utf-8"))
    rules = _rules()
    assert len(rules) >= 9
    for name, rule in rules.items():
        severity = re.search(r"^\s+severity: (\S+)$", rule, flags=re.MULTILINE)
        assert severity is not None and severity.group(1) in SEVERITIES, name
        runbook = re.search(r"^\s+runbook_url: (\S+)$", rule, flags=re.MULTILINE)
        assert runbook is not None, f"{name} has no runbook_url"
        base, _, anchor = runbook.group(1).partition("#")
        assert base == RUNBOOK_URL.partition("#")[0], name
        assert anchor in anchors, f"{name}: README.md has no section #{anchor}"


def test_the_rule_and_the_push_are_one_alert(tmp_path: Path) -> None:
    """The rule VllmSupervisorUnitHalted, on the halted gauge scraped from a host, has exactly
    the labels of the alert the daemon pushes for that halt, so Alertmanager keeps one."""
    pushed = alert("vllm.service", {"signature": "flashinfer_cubin_mismatch"}, host="gpu-7")
    labels = {k: v for k, v in pushed["labels"].items() if k != "alertname"}
    case = {
        "rule_files": [str(RULES_DIR / "alerts.yml")],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    {
                        "series": 'vllm_supervisor_unit_halted{instance="gpu-7:9464",'
                        'job="vllm-supervisor",unit="vllm.service"}',
                        "values": "1 1",
                    }
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "1m",
                        "alertname": pushed["labels"]["alertname"],
                        "exp_alerts": [
                            {"exp_labels": labels, "exp_annotations": _rule_annotations()}
                        ],
                    }
                ],
            }
        ],
    }
    path = tmp_path / "push_test.yml"
    path.write_text(json.dumps(case), encoding="utf-8")  # JSON is valid YAML
    result = _promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert pushed["annotations"]["runbook_url"] == RUNBOOK_URL


def _rule_annotations() -> dict[str, str]:
    """The halted rule's annotations for vllm.service on gpu-7, as alerts_test.yml has them."""
    return {
        "summary": "vllm.service on gpu-7 is halted after a fatal crash",
        "description": "vllm-supervisor stopped the restart loop of vllm.service on gpu-7: the "
        "crash is deterministic and a restart would repeat it. `vllm-supervisor status "
        "vllm.service` on the host shows the root cause and the fix; after fixing it, run "
        "`vllm-supervisor release vllm.service`.",
        "runbook_url": RUNBOOK_URL,
    }


HELD_UNTIL = "vllm_supervisor_unit_held_until_timestamp_seconds"


def _held_samples(metrics: Metrics) -> dict[str, float]:
    """The held-until gauge of the daemon's exposition: {unit: value}."""
    samples = {}
    for line in metrics.exposition()[0].decode().splitlines():
        if line.startswith(HELD_UNTIL + "{"):
            labels, value = line.rsplit(" ", 1)
            samples[re.findall(r'unit="([^"]*)"', labels)[0]] = float(value)
    return samples


def test_the_paced_rule_reads_the_daemons_gauge(tmp_path: Path) -> None:
    """VllmSupervisorUnitPaced on the gauge as the daemon exports it: a hold until 1500 s
    (Unix time, as the rule compares it with time()) decided at 60 s warns from 10 minutes on;
    a unit whose hold the scrape found expired reads 0 and stays quiet."""
    metrics = Metrics(new_registry(process=False))
    metrics.register_units(["vllm.service", "sglang.service"])
    metrics.held("vllm.service", Rule.TRANSIENT, 1500.0)
    metrics.held("sglang.service", Rule.UNKNOWN_FIRST, 120.0)
    metrics.held_units({"vllm.service": 1500.0, "sglang.service": 120.0}, now=180.0)
    held = _held_samples(metrics)
    assert held == {"vllm.service": 1500.0, "sglang.service": 0.0}
    series = [
        {
            "series": f'{HELD_UNTIL}{{instance="gpu-7:9464",job="vllm-supervisor",unit="{unit}"}}',
            "values": f"0 {value:g}x20",
        }
        for unit, value in held.items()
    ]
    expected = {"severity": "warning", "instance": "gpu-7:9464", "job": "vllm-supervisor"}
    case = {
        "rule_files": [str(RULES_DIR / "alerts.yml")],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    {"eval_time": "10m", "alertname": "VllmSupervisorUnitPaced", "exp_alerts": []},
                    {
                        "eval_time": "11m",
                        "alertname": "VllmSupervisorUnitPaced",
                        "exp_alerts": [
                            {
                                "exp_labels": {**expected, "unit": "vllm.service"},
                                "exp_annotations": _paced_annotations(
                                    "vllm.service", "gpu-7:9464", "1970-01-01 00:25:00 +0000 UTC"
                                ),
                            }
                        ],
                    },
                ],
            }
        ],
    }
    path = tmp_path / "paced_test.yml"
    path.write_text(json.dumps(case), encoding="utf-8")  # JSON is valid YAML
    result = _promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def _paced_annotations(unit: str, instance: str, next_start: str) -> dict[str, str]:
    """The paced rule's annotations, as alerts_test.yml has them."""
    return {
        "summary": f"{unit} on {instance} is paced: its starts keep crashing",
        "description": f"The starts of {unit} crash soon after they begin, on an error not proven "
        "fatal, so vllm-supervisor holds each next start for longer (the delay doubles per "
        f"crash) instead of halting it; the next start comes at {next_start}. "
        f"`vllm-supervisor status {unit}` on the host shows why and after how many crashes; "
        f"`vllm-supervisor release {unit}` starts it now.",
        "runbook_url": f"{RUNBOOK_URL.partition('#')[0]}#vllmsupervisorunitpaced",
    }


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
