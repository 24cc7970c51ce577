"""Alertmanager as a sink, against a real Alertmanager (Debian's prometheus-alertmanager) on
loopback: a halt fires VllmSupervisorUnitHalted with its labels and annotations, `release`
resolves it, and nothing is lost across an Alertmanager outage or a restart of either side.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import wait_for
from faults.harness import Supervisor, classified, crash, write_config
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.journal.writer import JournalWriter
from vllm_supervisor.notify.alertmanager import ALERT_NAME, alert

UNIT = "vllm.service"
BINARY = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"
AM_CONFIG = "route:\n  receiver: blackhole\nreceivers:\n  - name: blackhole\n"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Alertmanager:
    """A real Alertmanager started by the test (and killed only by it, by PID)."""

    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root, port
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, fresh: bool = False) -> None:
        storage = self.root / "storage"
        if fresh and storage.exists():
            shutil.rmtree(storage)
        storage.mkdir(parents=True, exist_ok=True)
        config = self.root / "alertmanager.yml"
        config.write_text(AM_CONFIG)
        log = (self.root / "alertmanager.log").open("ab")
        self.process = subprocess.Popen(
            [BINARY, f"--config.file={config}", f"--storage.path={storage}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--cluster.listen-address="],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )  # fmt: skip
        wait_for(self._ready, timeout=30, what="Alertmanager ready")

    def _ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=20)
        self.process = None

    def alerts(self) -> list[dict[str, Any]]:
        """The active alerts of ours (resolved ones are not returned)."""
        reply = httpx.get(f"{self.url}/api/v2/alerts", params={"filter": f"alertname={ALERT_NAME}"})
        reply.raise_for_status()
        return [a for a in reply.json() if a["status"]["state"] == "active"]


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
    """The alert's labels are bounded (unit, host, signature, severity); the annotations say the
    root cause, the remediation and the release command."""
    alertmanager.start()
    with JournalWriter(tmp_path / "journal") as writer:
        writer.write(crash("fatal", 1))
        supervisor.start()
        wait_for(lambda: alertmanager.alerts(), timeout=30, what="the alert")
    (fired,) = alertmanager.alerts()
    labels = fired["labels"]
    assert (labels["alertname"], labels["unit"], labels["severity"]) == (ALERT_NAME, UNIT, "fatal")
    assert labels["signature"] == "flashinfer_cubin_mismatch"
    assert labels["host"] == socket.gethostname()
    assert "flashinfer-cubin version" in fired["annotations"]["root_cause"]
    assert fired["annotations"]["release"] == f"vllm-supervisor release {UNIT}"
    assert "flashinfer-cubin==" in fired["annotations"]["remediation"]
    release(supervisor)
    wait_for(lambda: not alertmanager.alerts(), timeout=30, what="the alert resolved")


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
    wait_for(lambda: alertmanager.alerts(), timeout=30, what="the alert after the outage")
    alertmanager.stop()
    alertmanager.start(fresh=True)  # restarted with its storage lost
    wait_for(lambda: alertmanager.alerts(), timeout=30, what="the alert re-sent")
    supervisor.terminate()
    release(supervisor)  # while the daemon is down
    supervisor.start()
    wait_for(lambda: not alertmanager.alerts(), timeout=30, what="resolved after the restart")
    warnings = [e for e in supervisor.events() if e["event"] == "alertmanager_unreachable"]
    assert len(warnings) == 1, warnings  # one line per outage, not one per retry


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=9),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=9), inner),
    max_leaves=10,
)


@given(record=st.dictionaries(st.text(max_size=12), JSON, max_size=8), unit=st.text(min_size=1))
def test_any_record_makes_an_alert_with_bounded_string_labels(record: dict, unit: str) -> None:
    """A quarantine record is a file on disk: whatever it holds, the alert has the five labels
    as strings (Alertmanager rejects anything else) and string annotations."""
    made = alert(unit, record, host="gpu-7")
    assert set(made["labels"]) == {"alertname", "unit", "host", "signature", "severity"}
    assert all(
        isinstance(v, str) for v in [*made["labels"].values(), *made["annotations"].values()]
    )
