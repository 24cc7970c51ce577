"""Batch 2 of real vLLM failures under systemd 252 in systemd-nspawn (scenarios 23-48).

Usage: VLLM_REAL_ROOT=/var/tmp/vllm-venv python3 run_batch2.py OUTDIR SCENARIO...
Reuses run_scenarios.py (the container, the unit template, the loop driver, `save`).
Helpers on loopback stand in for the model hub (answering 429 / 503, or never answering) and
for a process holding the port; the kills stand in for the OOM killer and for a person.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_scenarios as rs  # noqa: E402
from run_scenarios import LOOP, ROOT, TINY, log, state, wait_for  # noqa: E402

# This shared host's other users hold 2-3 GiB: vLLM's CPU default (0.92 of RAM) no longer
# fits (scenario 25, recorded before this line), so every other start reserves half.
CPU_API = rs.CPU_API + " --gpu-memory-utilization 0.5"
QWEN = "Qwen/Qwen2.5-0.5B-Instruct"
HUB = "Environment=HF_HOME=/var/tmp/hf-empty\n"  # and NO HF_HUB_OFFLINE (see ONLINE)
HELPER = f"/usr/bin/python3 {ROOT}/tools/hub_stand_in.py"

# name -> (ExecStart, extra [Service] lines, invocations, kind, helper ExecStart or "")
SCENARIOS: dict[str, tuple[str, str, int, str, str]] = {
    "23-port-unparsable": (f"{CPU_API} --model {TINY} --port abc", "", 3, "loop", ""),
    "24-quantization-unknown": (f"{CPU_API} --model {TINY} --quantization nope", "", 3, "loop", ""),
    "25-cpu-memory-held-by-others": (  # meant as a bad VLLM_ATTENTION_BACKEND (ignored)
        f"{rs.CPU_API} --model {TINY} --max-model-len 256 --port 8021",
        LOOP + "\nEnvironment=VLLM_ATTENTION_BACKEND=NOPE", 3, "loop", ""),
    "26-kvcache-space-env-not-a-number": (
        f"{CPU_API} --model {TINY} --max-model-len 256 --port 8022",
        LOOP + "\nEnvironment=VLLM_CPU_KVCACHE_SPACE=lots", 3, "loop", ""),
    "27-tp-3-heads-not-divisible": (
        f"{CPU_API} --model {TINY} --tensor-parallel-size 3 --max-model-len 256 --port 8023",
        LOOP, 3, "loop", ""),
    "28-dtype-float16-cpu": (
        f"{CPU_API} --model {TINY} --dtype float16 --max-model-len 256 --port 8024", LOOP, 3,
        "loop", ""),
    "29-architecture-unknown": (
        f"{CPU_API} --model {ROOT}/models/tiny-arch --max-model-len 256 --port 8025", LOOP, 3,
        "loop", ""),
    "30-config-json-truncated": (
        f"{CPU_API} --model {ROOT}/models/tiny-badjson --max-model-len 256", "", 3, "loop", ""),
    "31-weights-missing": (
        f"{CPU_API} --model {ROOT}/models/tiny-noweights --max-model-len 256 --port 8026", LOOP,
        3, "loop", ""),
    "32-tokenizer-path-missing": (
        f"{CPU_API} --model {TINY} --tokenizer /models/nope-tokenizer --max-model-len 256", "",
        3, "loop", ""),
    "33-chat-template-missing": (
        f"{CPU_API} --model {TINY} --chat-template /etc/vllm/nope.jinja --max-model-len 256 "
        "--port 8027", LOOP, 3, "loop", ""),
    "34-ssl-keyfile-missing": (
        f"{CPU_API} --model {TINY} --ssl-keyfile /etc/vllm/nope.key --ssl-certfile "
        "/etc/vllm/nope.crt --max-model-len 256 --port 8028", LOOP, 3, "loop", ""),
    "35-host-address-not-local": (
        f"{CPU_API} --model {TINY} --host 10.255.255.1 --port 8029 --max-model-len 256", LOOP, 3,
        "loop", ""),
    "36-batched-tokens-below-model-len": (
        f"{CPU_API} --model {TINY} --max-model-len 512 --max-num-batched-tokens 64 --port 8030",
        LOOP, 3, "loop", ""),
    "37-kv-heads-mismatch-weights": (
        f"{CPU_API} --model {ROOT}/models/tiny-kvheads --max-model-len 256 --port 8031", LOOP, 3,
        "loop", ""),
    "38-model-dir-permission-denied": (
        f"{CPU_API} --model {ROOT}/models/tiny-private --max-model-len 256 --port 8032",
        LOOP + "\nUser=nobody\nEnvironment=HOME=/tmp", 3, "loop", ""),
    "40-hub-connection-refused": (
        f"{CPU_API} --model {QWEN}", HUB + "Environment=HF_ENDPOINT=http://127.0.0.1:9", 3, "loop",
        ""),
    "41-hub-429": (
        f"{CPU_API} --model {QWEN}", HUB + "Environment=HF_ENDPOINT=http://127.0.0.1:8091", 3,
        "loop", f"{HELPER} 8091 429"),
    "42-hub-503": (
        f"{CPU_API} --model {QWEN}", HUB + "Environment=HF_ENDPOINT=http://127.0.0.1:8092", 3,
        "loop", f"{HELPER} 8092 503"),
    "43-hub-no-answer": (
        f"{CPU_API} --model {QWEN}",
        HUB + "Environment=HF_ENDPOINT=http://127.0.0.1:8093\nEnvironment=HF_HUB_ETAG_TIMEOUT=5"
        "\nEnvironment=HF_HUB_DOWNLOAD_TIMEOUT=5", 3, "loop", f"{HELPER} 8093 hang"),
    "44-port-held-briefly": (
        f"{CPU_API} --model {TINY} --port 8094 --max-model-len 256", LOOP, 3, "port-brief",
        "/usr/bin/python3 -m http.server 8094 --bind 0.0.0.0"),
    "45-main-sigkill-during-load": (
        f"{CPU_API} --model {TINY} --port 8095 --max-model-len 256", LOOP, 2, "kill:main:9", ""),
    "46-main-sigterm-during-load": (
        f"{CPU_API} --model {TINY} --port 8096 --max-model-len 256", LOOP, 2, "kill:main:15", ""),
    "47-enginecore-sigterm-during-load": (
        f"{CPU_API} --model {TINY} --port 8097 --max-model-len 256", LOOP, 2,
        "kill:VLLM::EngineCor:15", ""),
    "48-worker-sigkill-during-load": (
        f"{CPU_API} --model {TINY} --port 8098 --max-model-len 256", LOOP, 2,
        "kill:VLLM::Worker:9", ""),
}
ONLINE = {n for n, s in SCENARIOS.items() if s[1].startswith(HUB)}
LOOP_TIMEOUT_S = 150


def unit_text(name: str, cmd: str, extra: str) -> str:
    text = rs.UNIT.format(name=name, cmd=cmd, extra=extra)
    return text.replace("Environment=HF_HUB_OFFLINE=1\n", "") if name in ONLINE else text


def put_unit(box: rs.Container, name: str, cmd: str, extra: str) -> str:
    unit = f"vllm-{name}.service"
    box.write_file(f"/etc/systemd/system/{unit}", unit_text(name, cmd, extra))
    box.systemctl("daemon-reload")
    return unit


def kill_during_load(box: rs.Container, unit: str, target: str, sig: int, invocations: int,
                     notes: list[str]) -> None:
    """Send `sig` to the main process (target "main") or to the first process whose comm
    starts with `target`, 4 s after the engine core appeared (the model is loading)."""
    box.systemctl("start", unit, check=False)
    for n in range(invocations):
        wait_for(lambda: rs.find_comm(box, "VLLM::EngineCor")[0], timeout=150,
                 what="EngineCore process", interval=0.2)
        if target == "main":
            time.sleep(4)
            s = state(box, unit)
            pid = int(s["MainPID"])
        else:
            pid = wait_for(lambda: rs.find_comm(box, target)[0], timeout=60, what=target,
                           interval=0.2)
            time.sleep(4 if target.startswith("VLLM::EngineCor") else 1)
            s = state(box, unit)
        rs.kill_and_note(box, unit, pid, sig, target, n, notes)
        rs.await_restart(box, unit, n, invocations)
    rs.stop_after_last(box, unit)


def port_held_briefly(box: rs.Container, unit: str, blocker_cmd: str, notes: list[str]) -> None:
    """Another process holds the port for the first start only; the next start serves."""
    blocker = put_unit(box, "port-holder", blocker_cmd, "")
    box.systemctl("start", blocker)
    time.sleep(2)
    box.systemctl("start", unit, check=False)
    wait_for(lambda: int(state(box, unit)["NRestarts"] or 0) >= 1, timeout=200,
             what="first crash", interval=0.2)
    box.systemctl("stop", blocker, check=False)
    notes.append("holder stopped after the first crash at " + time.strftime("%H:%M:%S"))
    try:
        rs.wait_healthy(box, 8094, unit, timeout=240)
        notes.append("served after the holder left: " + rs.curl(
            box, "http://127.0.0.1:8094/health", timeout=5)[-12:])
    finally:
        box.systemctl("stop", unit, check=False)


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so the container is powered off and its cgroups removed


# How a scenario is driven once its unit is in: box, unit, ExecStart, invocations, kind,
# helper ExecStart, notes.
Drive = Callable[[rs.Container, str, str, int, str, str, list[str]], None]


def run_batch(scenarios: dict[str, tuple[str, str, int, str, str]], drive: Drive,
              helper_first: Callable[[str], bool] = lambda kind: True) -> None:
    """The scenarios named on the command line, one after another in one container: each
    unit put in, its helper unit started first when it has one (and `helper_first(kind)`),
    driven, its journal saved; the container powered off at the end."""
    signal.signal(signal.SIGTERM, _stop)
    out = Path(sys.argv[1])
    names = sys.argv[2:]
    (out / "work").mkdir(parents=True, exist_ok=True)
    with rs.booted_container([(ROOT, ROOT)], workdir=out / "work") as box:
        log(f"container up, leader {box.leader}")
        for name in names:
            cmd, extra, invocations, kind, helper = scenarios[name]
            unit = put_unit(box, name, cmd, extra)
            notes: list[str] = []
            (out / "work" / f"{name}.unit").write_text(
                box.run("systemctl", "cat", unit, check=False).stdout)
            t0 = time.monotonic()
            helper_unit = None
            try:
                if helper and helper_first(kind):
                    helper_unit = put_unit(box, f"{name}-helper", helper, "")
                    box.systemctl("start", helper_unit)
                    time.sleep(2)
                drive(box, unit, cmd, invocations, kind, helper, notes)
            except Exception as exc:  # keep going: save what happened
                notes.append(f"driver: {type(exc).__name__}: {exc}")
                box.systemctl("stop", unit, check=False)
            finally:
                if helper_unit:
                    box.systemctl("stop", helper_unit, check=False)
            rs.save_and_report(box, unit, out, name, notes, t0)
    log("container down")


def _drive(box: rs.Container, unit: str, cmd: str, invocations: int, kind: str, helper: str,
           notes: list[str]) -> None:
    if kind == "loop":
        box.systemctl("start", unit, check=False)
        rs.wait_restarts(box, unit, invocations, timeout=LOOP_TIMEOUT_S * invocations)
    elif kind == "port-brief":
        port_held_briefly(box, unit, helper, notes)
    elif kind.startswith("kill:"):
        target, sig = kind.removeprefix("kill:").rsplit(":", 1)
        kill_during_load(box, unit, target, int(sig), invocations, notes)


def main() -> None:
    run_batch(SCENARIOS, _drive, helper_first=lambda kind: kind == "loop")


if __name__ == "__main__":
    main()
