"""D-Bus unavailable under a real `vllm-supervisor run` child (systemd control on, no bus).

The mapping of each D-Bus failure (unavailable, access denied, timeout) and the Halter's
bounded retries are proven against a real dbus-daemon in tests/test_systemd_errors.py, and the
polkit refusal under a real systemd in tests/e2e/test_polkit_e2e.py; this is the daemon's side:
the decision is recorded, the failure reported in the log, a metric, history and Slack.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

from conftest import wait_for
from slack_server import SECRET, SlackServer

from faults.harness import Supervisor, crash, db_rows, history_cli, write_config
from vllm_supervisor.journal.writer import JournalWriter

SYSTEMD = "enabled = true\nstop_attempts = 3\nstop_timeout_s = 1.0\n"
FAILURES = 'vllm_supervisor_halt_failures_total{reason="bus_unavailable",unit="vllm.service"}'


def _events(sup: Supervisor, name: str) -> list[dict[str, Any]]:
    return [e for e in sup.events() if e.get("event") == name]


def _metric(sup: Supervisor, sample: str) -> float:
    port = _events(sup, "metrics_listening")[-1]["port"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return next((float(x.split()[-1]) for x in text.splitlines() if x.startswith(sample)), 0.0)


class TestBusUnavailable:
    """The system bus socket does not exist."""

    def test_halt_is_recorded_and_its_failure_reported_everywhere(
        self, tmp_path: Path, slack: SlackServer, supervisors: list[Supervisor]
    ) -> None:
        """A fatal crash: quarantined anyway, StopUnit tried 3 times (bounded), and the failure
        is in the log, the halt_failures metric, the history's decision and the Slack message;
        the daemon keeps running."""
        config = write_config(tmp_path, slack_url=slack.url, systemd=SYSTEMD)
        sup = Supervisor(tmp_path, config, env={"DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/no/bus"})
        supervisors.append(sup)
        (tmp_path / "journal").mkdir()
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(crash("fatal", 1))
            sup.start()
            wait_for(
                lambda: db_rows(tmp_path / "state", "SELECT notified FROM history") == [(1,)],
                what="the crash recorded and announced",
            )
            assert sup.alive()
            assert (tmp_path / "run" / "quarantine" / "vllm.service.json").exists()
            assert _metric(sup, FAILURES) == 1.0
            assert _metric(sup, 'vllm_supervisor_unit_halted{unit="vllm.service"}') == 1.0
        assert sup.terminate() == 0, sup.stderr_text()
        assert _events(sup, "systemd_unavailable")
        failed = _events(sup, "systemd_action_failed")
        assert [(e["action"], e["attempts"], e["reason"]) for e in failed] == [
            ("stop", 3, "bus_unavailable")
        ]
        item = history_cli(tmp_path / "state")[0]
        assert item["decision"]["action"] == "halt"
        assert item["taken"] == "quarantined"  # the gate refuses the next start; no stop
        assert "stop failed (bus_unavailable)" in item["taken_detail"]
        message = json.dumps(slack.requests[0].json(), ensure_ascii=False)
        assert "halt → quarantined: its gate refuses the next start" in message
        assert "stop failed (bus_unavailable)" in message
        assert SECRET not in "".join(p.read_text(errors="replace") for p in sup.logs)
