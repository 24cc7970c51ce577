"""A real Alertmanager (Debian's prometheus-alertmanager) on loopback, started by a test and
stopped only by it, by PID."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx
from conftest import wait_for

BINARY = shutil.which("prometheus-alertmanager") or "/usr/bin/prometheus-alertmanager"
AM_CONFIG = "route:\n  receiver: blackhole\nreceivers:\n  - name: blackhole\n"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Alertmanager:
    """A real Alertmanager started by the test (and killed only by it, by PID)."""

    def __init__(self, root: Path, port: int, config: str = AM_CONFIG) -> None:
        self.root, self.port, self.config = root, port, config
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
        config.write_text(self.config)
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

    def alerts(self, alertname: str) -> list[dict[str, Any]]:
        """The alerts of one name Alertmanager has processed, active or suppressed (resolved
        ones are not returned)."""
        reply = httpx.get(f"{self.url}/api/v2/alerts", params={"filter": f"alertname={alertname}"})
        reply.raise_for_status()
        return [a for a in reply.json() if a["status"]["state"] != "unprocessed"]

    def settled(self) -> bool:
        """True when no alert waits to be processed (every group has had its flush)."""
        reply = httpx.get(f"{self.url}/api/v2/alerts", timeout=5)
        reply.raise_for_status()
        return all(a["status"]["state"] != "unprocessed" for a in reply.json())

    def post(self, alerts: list[dict[str, Any]]) -> None:
        """Post alerts as anyone who can reach the API can."""
        httpx.post(f"{self.url}/api/v2/alerts", json=alerts, timeout=5).raise_for_status()
