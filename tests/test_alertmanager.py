"""Alertmanager as a sink, against a real Alertmanager (Debian's prometheus-alertmanager) on
loopback: a halt fires VllmSupervisorUnitHalted with its labels and annotations, `release`
resolves it, and nothing is lost across an Alertmanager outage or a restart of either side.
With a real Prometheus running the shipped rule as well, one halt is one alert and one
notification.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from alertmanager_server import Alertmanager, free_port
from conftest import wait_for
from faults.harness import Supervisor, classified, crash, write_config
from hypothesis import given
from hypothesis import strategies as st
from slack_server import SlackServer

from vllm_supervisor.journal.writer import JournalWriter
from vllm_supervisor.notify.alertmanager import ALERT_NAME, RUNBOOK_URL, alert

UNIT = "vllm.service"
ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
GROUP_INTERVAL_S = 1.0


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[Alertmanager]:
    manager = Alertmanager(tmp_path / "am", free_port())
    yield manager
    manager.stop()


@pytest.fixture
def supervisor(tmp_path: Path, alertmanager: Alertmanager) -> Iterator[Supervisor]:
    extra = f'[alertmanager]\nurl = "{alertmanager.url}"\nresend_s = 1.0\nbackoff_max_s = 0.5\n'
    config = write_config(tmp_path, extra=extra)
    sup = Supervisor(tmp_path, config, env={"DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/no/bus"})
    yield sup
    sup.stop_quietly()


def release(sup: Supervisor) -> None:
    subprocess.run(
        [sys.executable, "-m", "vllm_supervisor", "release", UNIT, "--config", str(sup.config)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip


def test_a_halt_fires_and_a_release_resolves(
    tmp_path: Path, alertmanager: Alertmanager, supervisor: Supervisor
) -> None:
    """The alert's labels are the shipped rule's (alertname, host, unit, severity="critical");
    the annotations say the signature, the root cause, the remediation, the release command
    and the runbook."""
    alertmanager.start()
    with JournalWriter(tmp_path / "journal") as writer:
        writer.write(crash("fatal", 1))
        supervisor.start()
        wait_for(lambda: alertmanager.alerts(ALERT_NAME), timeout=30, what="the alert")
    (fired,) = alertmanager.alerts(ALERT_NAME)
    assert fired["labels"] == {
        "alertname": ALERT_NAME,
        "host": socket.gethostname(),
        "unit": UNIT,
        "severity": "critical",
    }
    assert fired["annotations"]["signature"] == "flashinfer_cubin_mismatch"
    assert fired["annotations"]["crash_severity"] == "fatal"
    assert fired["annotations"]["runbook_url"] == RUNBOOK_URL
    assert "flashinfer-cubin version" in fired["annotations"]["root_cause"]
    assert fired["annotations"]["release"] == f"vllm-supervisor release {UNIT}"
    assert "flashinfer-cubin==" in fired["annotations"]["remediation"]
    release(supervisor)
    wait_for(lambda: not alertmanager.alerts(ALERT_NAME), timeout=30, what="the alert resolved")


def test_an_outage_and_restarts_lose_nothing(
    tmp_path: Path, alertmanager: Alertmanager, supervisor: Supervisor
) -> None:
    """Halted while Alertmanager is down: it fires once Alertmanager is back. Alertmanager
    restarted empty: it fires again at the next round. Released while the daemon is down: it
    is resolved after the daemon's restart."""
    with JournalWriter(tmp_path / "journal") as writer:
        writer.write(crash("fatal", 1))
        supervisor.start()
        wait_for(lambda: len(classified(tmp_path / "state")) == 1, timeout=60, what="the halt")
    alertmanager.start()  # it was down during the halt
    wait_for(lambda: alertmanager.alerts(ALERT_NAME), timeout=30, what="the alert after the outage")
    alertmanager.stop()
    alertmanager.start(fresh=True)  # restarted with its storage lost
    wait_for(lambda: alertmanager.alerts(ALERT_NAME), timeout=30, what="the alert re-sent")
    supervisor.terminate()
    release(supervisor)  # while the daemon is down
    supervisor.start()
    wait_for(
        lambda: not alertmanager.alerts(ALERT_NAME), timeout=30, what="resolved after the restart"
    )
    warnings = [e for e in supervisor.events() if e["event"] == "alertmanager_unreachable"]
    assert len(warnings) == 1, warnings  # one line per outage, not one per retry


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=9),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=9), inner),
    max_leaves=10,
)


@given(record=st.dictionaries(st.text(max_size=12), JSON, max_size=8), unit=st.text(min_size=1))
def test_any_record_makes_an_alert_with_bounded_string_labels(record: dict, unit: str) -> None:
    """A quarantine record is a file on disk: whatever it holds, the alert has the rule's four
    labels, none taken from the record, as strings (Alertmanager rejects anything else) and
    string annotations."""
    made = alert(unit, record, host="gpu-7")
    assert made["labels"] == {
        "alertname": ALERT_NAME,
        "host": "gpu-7",
        "unit": unit,
        "severity": "critical",
    }
    assert all(
        isinstance(v, str) for v in [*made["labels"].values(), *made["annotations"].values()]
    )


# One notification per group change, at once and then at most once per GROUP_INTERVAL_S; resolved
# alerts are not sent, so every notification is a page.
PAGING_CONFIG = """\
route:
  receiver: pager
  group_by: [alertname, host, unit]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: pager
    webhook_configs:
      - url: {url}
        send_resolved: false
"""


class Prometheus:
    """A real Prometheus with the shipped rules, scraping one supervisor and alerting to one
    Alertmanager (started and stopped by the test, by PID)."""

    def __init__(self, root: Path, *, target_port: int, alertmanager: Alertmanager) -> None:
        self.root, self.port = root, free_port()
        self.root.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "alerting": {
                "alertmanagers": [
                    {"static_configs": [{"targets": [f"127.0.0.1:{alertmanager.port}"]}]}
                ]
            },
            "scrape_configs": [
                {
                    "job_name": "vllm-supervisor",
                    # deploy/README.md's recipe: the target named by its host's `hostname`.
                    "static_configs": [
                        {
                            "targets": [f"127.0.0.1:{target_port}"],
                            "labels": {"hostname": socket.gethostname()},
                        }
                    ],
                    "relabel_configs": [
                        {
                            "source_labels": ["hostname", "__address__"],
                            "regex": "(.+);.*:([0-9]+)",
                            "target_label": "instance",
                            "replacement": "$1:$2",
                        }
                    ],
                }
            ],
        }
        self.config = self.root / "prometheus.yml"
        self.config.write_text(json.dumps(config), encoding="utf-8")  # JSON is valid YAML
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = (self.root / "prometheus.log").open("ab")
        self.process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={self.config}",
             f"--storage.tsdb.path={self.root / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )  # fmt: skip

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=20)

    def firing(self) -> list[dict[str, Any]]:
        """The rule's alerts of ours that fire now."""
        try:
            reply = httpx.get(f"http://127.0.0.1:{self.port}/api/v1/alerts", timeout=2)
        except httpx.HTTPError:
            return []
        alerts = reply.json()["data"]["alerts"]
        return [
            a for a in alerts if a["labels"]["alertname"] == ALERT_NAME and a["state"] == "firing"
        ]

    def sent(self) -> float:
        """Alerts this Prometheus has posted to Alertmanager so far (its own counter)."""
        try:
            text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=2).text
        except httpx.HTTPError:
            return 0.0
        lines = [
            x for x in text.splitlines() if x.startswith("prometheus_notifications_sent_total")
        ]
        return sum(float(x.rsplit(" ", 1)[1]) for x in lines)


def notified_alerts(pager: SlackServer) -> list[list[dict[str, str]]]:
    """The labels of the alerts in each notification Alertmanager sent, in order."""
    return [[a["labels"] for a in r.json()["alerts"]] for r in pager.requests]


def stays(condition: Callable[[], bool], *, for_s: float, what: str) -> None:
    """Fail as soon as `condition` turns false within `for_s`: nothing more may happen then."""
    deadline = time.monotonic() + for_s
    while time.monotonic() < deadline:
        assert condition(), what
        time.sleep(0.05)


def test_the_push_and_the_rule_page_once_per_halt(tmp_path: Path) -> None:
    """Both roads configured, a real Prometheus running the shipped rule and the daemon pushing:
    Alertmanager holds one alert and sends one notification for the halt (the two alerts have
    the same labels), and a release resolves it on both roads."""
    pager = SlackServer()
    pager.start()
    manager = Alertmanager(tmp_path / "am", free_port(), PAGING_CONFIG.format(url=pager.url))
    metrics_port = free_port()
    config = write_config(
        tmp_path, extra=f'[alertmanager]\nurl = "{manager.url}"\nresend_s = 1.0\n'
    )
    text = config.read_text(encoding="utf-8")
    config.write_text(text.replace('"127.0.0.1:0"', f'"127.0.0.1:{metrics_port}"'))
    sup = Supervisor(tmp_path, config, env={"DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/no/bus"})
    prometheus = Prometheus(tmp_path / "prom", target_port=metrics_port, alertmanager=manager)
    try:
        manager.start()
        prometheus.start()
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(crash("fatal", 1))
            sup.start()
            wait_for(lambda: manager.alerts(ALERT_NAME), timeout=60, what="the pushed alert")
        wait_for(lambda: prometheus.firing(), timeout=60, what="the rule firing")
        wait_for(lambda: prometheus.sent() >= 1, timeout=30, what="Prometheus posting the rule")
        wait_for(lambda: pager.count() >= 1, timeout=30, what="the page")
        # Both alerts are in Alertmanager now: a second page would come within a group
        # interval or two (its group changed); none may.
        stays(lambda: pager.count() == 1, for_s=4 * GROUP_INTERVAL_S, what="a second page")
        expected = {"alertname": ALERT_NAME, "host": socket.gethostname(), "unit": UNIT,
                    "severity": "critical"}  # fmt: skip
        assert notified_alerts(pager) == [[expected]]
        assert [a["labels"] for a in manager.alerts(ALERT_NAME)] == [expected]
        assert prometheus.firing()[0]["labels"] == expected
        release(sup)
        wait_for(lambda: not manager.alerts(ALERT_NAME), timeout=30, what="the alert resolved")
        wait_for(lambda: not prometheus.firing(), timeout=30, what="the rule resolved")
        assert pager.count() == 1
    finally:
        sup.stop_quietly()
        prometheus.stop()
        manager.stop()
        pager.stop()
