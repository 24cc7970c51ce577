"""What a client types never takes a healthy server down (systemd 252 in nspawn).

Seen before on this systemd: a unit without `health_url`, vLLM's request logging on; a client
sent a prompt holding vLLM's EngineDeadError line and the flashinfer error text, which vLLM
logs in its INFO "Received request ... prompt: '...'" line. The healthy server was closed as
hung, the prompt became the root cause (`flashinfer_cubin_mismatch`, fatal), and the unit was
quarantined and stopped. Anyone who could reach the API could do it.
"""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest
from nspawn import Container, wait_for
from served import QUARANTINE, UNIT, container, history, quarantined, start_supervisor

pytestmark = pytest.mark.nspawn
__all__ = ["container"]  # the fixture, used by name

PROMPTED_UNIT = """[Unit]
Description=a healthy fake vLLM server with request logging on
StartLimitIntervalSec=0

[Service]
ExecStart=/usr/bin/python3 /opt/vsup/e2e/fake-prompted-server.py --port {port}
Restart=always
"""
# No health_url: the daemon may only probe the port it reads from ExecStart= itself.
CONFIG = """[[unit]]
name = "vllm.service"
hang_grace_s = 1.0

[metrics]
listen = "127.0.0.1:{metrics_port}"
"""
ATTACKS = (
    "hi\n(APIServer pid=41207) ERROR 03-03 09:14:31 [async_llm.py:480] AsyncLLM output_handler"
    " failed.\n(APIServer pid=41207) ERROR 03-03 09:14:31 [async_llm.py:480]"
    " vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
    "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
    "RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version (0.6.4)."
    " Please install the same version of both packages.",
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def ask(url: str, body: dict[str, str] | None = None) -> int:
    data = json.dumps(body).encode() if body is not None else None
    with urllib.request.urlopen(url, data=data, timeout=5) as answer:  # noqa: S310 - loopback
        return int(answer.status)


def entries_read(metrics_port: int) -> float:
    """The daemon's journal entries read so far (its own port: the host's loopback is shared
    with any other container a parallel run boots)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("vllm_supervisor_journal_entries_total "):
                return float(line.split()[1])
    return 0.0


def test_a_prompt_holding_crash_lines_changes_nothing(container: Container) -> None:
    port = free_port()
    container.write_file(f"/etc/systemd/system/{UNIT}", PROMPTED_UNIT.format(port=port))
    container.systemctl("daemon-reload")
    metrics_port = free_port()
    start_supervisor(container, CONFIG.format(metrics_port=metrics_port))
    container.systemctl("start", UNIT)

    def healthy() -> bool:
        try:
            return ask(f"http://127.0.0.1:{port}/health") == 200
        except OSError:
            return False

    wait_for(healthy, timeout=30, what="the server to answer")
    pid = container.show(UNIT, "MainPID")["MainPID"]
    before = entries_read(metrics_port)
    for prompt in ATTACKS * 3:
        assert ask(f"http://127.0.0.1:{port}/v1/completions", {"prompt": prompt}) == 200
    wait_for(lambda: entries_read(metrics_port) >= before + len(ATTACKS) * 3, timeout=30,
             what="the supervisor to read the request lines")  # fmt: skip

    def acted() -> bool:
        return quarantined(container) or container.show(UNIT, "MainPID")["MainPID"] != pid

    # Past the hang grace (1 s) and the probe: anything the supervisor would do, it does here.
    with pytest.raises(TimeoutError):
        wait_for(acted, timeout=6, what="the supervisor to act on a prompt")
    assert healthy()

    container.systemctl("stop", UNIT)
    wait_for(lambda: history(container) or None, timeout=30, what="the run recorded")
    (run,) = history(container)
    assert (run["ending"], run["decision"]["action"]) == ("stopped", "observe"), run
    said = json.dumps(run["verdict"])
    assert "flashinfer" not in said and "EngineDead" not in said, run["verdict"]
    assert container.run("test", "-e", QUARANTINE, check=False).returncode != 0
