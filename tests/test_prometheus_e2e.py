"""A real Prometheus scrapes the live daemon during a replayed fatal crash loop and alerts.

Scenario:
1. A fatal crash loop (the flashinfer-cubin mismatch, three invocations) is written into a real
   journal directory with systemd-journal-remote.
2. `vllm-supervisor run --directory DIR --metrics-listen 127.0.0.1:PORT` follows it (systemd
   calls off: the halt is recorded as a quarantine, no unit is stopped).
3. A real `prometheus` scrapes it every second with deploy/prometheus/alerts.yml loaded.
Result: the crashes are in Prometheus, and VllmSupervisorUnitHalted fires for the unit.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_supervisor.commands.demo import DEMO_UNIT, write_demo_journal

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DEADLINE_S = 90.0

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(
        shutil.which("prometheus") is None
        or shutil.which("/lib/systemd/systemd-journal-remote") is None,
        reason="needs the Debian prometheus and systemd-journal-remote packages",
    ),
]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback http only
        return json.load(response)


def _wait(
    condition: Callable[[], Any],
    what: str,
    procs: list[subprocess.Popen[bytes]],
    within: float = DEADLINE_S,
) -> Any:
    """Poll `condition` until it returns something truthy; fail early if a process died."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                pytest.fail(f"{proc.args[0]} exited with {proc.returncode} while waiting: {what}")
        try:
            result = condition()
        except OSError:
            result = None
        if result:
            return result
        time.sleep(0.2)
    pytest.fail(f"timed out after {within}s waiting for {what}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate a process this test started (by its PID), killing it if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture(name="daemon", scope="module")
def _daemon(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    tmp_path = tmp_path_factory.mktemp("supervisor")
    journal = tmp_path / "journal"
    write_demo_journal(journal)
    config = tmp_path / "supervisor.toml"
    config.write_text(
        f'[[unit]]\nname = "{DEMO_UNIT}"\n\n[journal]\nstart_at = "head"\n\n'
        "[systemd]\nenabled = false\n",
        encoding="utf-8",
    )
    port = _free_port()
    log = (tmp_path / "daemon.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm_supervisor",
            "run",
            "--config",
            str(config),
            "--directory",
            str(journal),
            "--state-dir",
            str(tmp_path / "state"),
            "--runtime-dir",
            str(tmp_path / "run"),
            "--metrics-listen",
            f"127.0.0.1:{port}",
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc, port
    finally:
        _stop(proc)
        log.close()


@pytest.fixture(name="prometheus", scope="module")
def _prometheus(
    tmp_path_factory: pytest.TempPathFactory, daemon: tuple[subprocess.Popen[bytes], int]
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    tmp_path = tmp_path_factory.mktemp("prometheus")
    _, target = daemon
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(  # JSON is valid YAML
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "rule_files": [str(ALERTS)],
                "scrape_configs": [
                    {
                        "job_name": "vllm-supervisor",
                        "static_configs": [{"targets": [f"127.0.0.1:{target}"]}],
                    }
                ],
            }
        ),
        encoding="utf-8",
    )
    port = _free_port()
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield proc, port
    finally:
        _stop(proc)
        log.close()


def _query(port: int, expr: str) -> list[dict[str, Any]]:
    query = urllib.parse.urlencode({"query": expr})
    return list(_get_json(f"http://127.0.0.1:{port}/api/v1/query?{query}")["data"]["result"])


def _firing(port: int, name: str) -> list[dict[str, Any]]:
    alerts = _get_json(f"http://127.0.0.1:{port}/api/v1/alerts")["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == name and a["state"] == "firing"]


def test_crash_loop_is_scraped(
    daemon: tuple[subprocess.Popen[bytes], int],
    prometheus: tuple[subprocess.Popen[bytes], int],
) -> None:
    """Prometheus scrapes the live daemon: it follows the journal and counts the fatal crashes."""
    supervisor, _ = daemon
    server, port = prometheus
    procs = [supervisor, server]
    _wait(lambda: _query(port, 'up{job="vllm-supervisor"} == 1'), "the first scrape", procs)
    crashes = _wait(
        lambda: _query(
            port, 'vllm_supervisor_crashes_total{signature="flashinfer_cubin_mismatch"} >= 1'
        ),
        "the fatal crash in Prometheus",
        procs,
    )
    assert crashes[0]["metric"]["unit"] == DEMO_UNIT
    assert _query(port, "vllm_supervisor_journal_following == 1")
    decisions = 'vllm_supervisor_decisions_total{action="halt",dry_run="false"} >= 1'
    assert _wait(lambda: _query(port, decisions), "the halt decision", procs)


def test_unit_halted_alert_fires(
    daemon: tuple[subprocess.Popen[bytes], int],
    prometheus: tuple[subprocess.Popen[bytes], int],
) -> None:
    """Once the halt is scraped, VllmSupervisorUnitHalted fires for the unit."""
    supervisor, _ = daemon
    server, port = prometheus
    procs = [supervisor, server]
    halted = 'vllm_supervisor_decisions_total{action="halt",dry_run="false"} >= 1'
    _wait(lambda: _query(port, halted), "the halt decision", procs)
    # The halt happens before its batch commits, so a few evaluation cycles are enough.
    alerts = _wait(
        lambda: _firing(port, "VllmSupervisorUnitHalted"), "the unit-halted alert", procs, 20.0
    )
    assert alerts[0]["labels"]["unit"] == DEMO_UNIT
    assert "vllm-supervisor release vllm.service" in alerts[0]["annotations"]["description"]
