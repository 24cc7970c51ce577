"""Batch 3 of real vLLM failures under systemd 252 in systemd-nspawn (scenarios 50-69).

Usage: VLLM_REAL_ROOT=/var/tmp/vllm-venv python3 run_batch3.py OUTDIR SCENARIO...
Reuses run_scenarios.py (the container, the unit template, the loop driver, `save`) and
run_batch2.py (the unit writer, the kill-during-load driver, the hub stand-in). New here: kills
of the main process while it serves (a person's `kill`, the OOM killer's stand-in), and hub
stand-ins that answer 500, reset the connection or say the repository does not exist.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_batch2 as b2  # noqa: E402
import run_scenarios as rs  # noqa: E402
from run_scenarios import LOOP, ROOT, TINY, state, wait_for  # noqa: E402

CPU_API = b2.CPU_API  # with --gpu-memory-utilization 0.5 (this host's memory is shared)
M = f"{ROOT}/models"
QWEN = b2.QWEN
HUB = b2.HUB  # an empty HF_HOME; the unit gets no HF_HUB_OFFLINE (see b2.ONLINE)
HELPER = b2.HELPER


def hub(port: int, extra: str = "") -> str:
    return HUB + f"Environment=HF_ENDPOINT=http://127.0.0.1:{port}" + extra


# name -> (ExecStart, extra [Service] lines, invocations, kind, helper ExecStart or "")
SCENARIOS: dict[str, tuple[str, str, int, str, str]] = {
    "50-speculative-config-bad-json": (
        f"{CPU_API} --model {TINY} --max-model-len 256 "
        "--speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 3'",
        "", 3, "loop", ""),
    "51-hf-overrides-not-json": (
        f"{CPU_API} --model {TINY} --max-model-len 256 --hf-overrides '{{\"rope_theta\": 1e6'",
        "", 3, "loop", ""),
    "52-served-model-name-empty-env": (
        f"{CPU_API} --model {TINY} --max-model-len 256 --served-model-name ${{SERVED_NAME}}",
        "", 3, "loop", ""),
    "53-max-num-seqs-zero": (
        f"{CPU_API} --model {TINY} --max-model-len 256 --max-num-seqs 0", "", 3, "loop", ""),
    "54-max-lora-rank-not-a-choice": (
        f"{CPU_API} --model {TINY} --max-model-len 256 --enable-lora --max-lora-rank 7", "", 3,
        "loop", ""),
    "55-load-format-unknown": (
        f"{CPU_API} --model {TINY} --max-model-len 256 --load-format bogus --port 8050", LOOP, 3,
        "loop", ""),
    "56-tokenizer-mode-unknown": (
        f"{CPU_API} --model {TINY} --max-model-len 256 --tokenizer-mode bogus", "", 3, "loop",
        ""),
    "57-heads-not-dividing-hidden-size": (
        f"{CPU_API} --model {M}/tiny-headsplit --max-model-len 256 --port 8051", LOOP, 3, "loop",
        ""),
    "58-config-without-architectures": (
        f"{CPU_API} --model {M}/tiny-noarch --max-model-len 256 --port 8052", LOOP, 3, "loop",
        ""),
    "59-tokenizer-config-truncated": (
        f"{CPU_API} --model {M}/tiny-tokcfg-badjson --max-model-len 256 --port 8053", LOOP, 3,
        "loop", ""),
    "60-remote-code-import-error": (
        f"{CPU_API} --model {M}/tiny-remote-importerror --trust-remote-code --max-model-len 256 "
        "--port 8054", LOOP, 3, "loop", ""),
    "61-omp-bind-cores-missing": (
        f"{CPU_API} --model {TINY} --max-model-len 256 --port 8055",
        LOOP + "\nEnvironment=VLLM_CPU_OMP_THREADS_BIND=6-7", 3, "loop", ""),
    "62-chat-template-syntax-error": (
        f"{CPU_API} --model {TINY} --max-model-len 256 --port 8056 "
        "--chat-template \"{%% for m in messages %%}{{ m['content'] }\"", LOOP, 3, "loop",
        ""),
    "63-block-size-7": (
        f"{CPU_API} --model {TINY} --max-model-len 256 --block-size 7 --port 8057", LOOP, 3,
        "loop", ""),
    "64-pipeline-parallel-2-cpu": (
        f"{CPU_API} --model {TINY} --max-model-len 256 --pipeline-parallel-size 2 --port 8058",
        LOOP, 3, "loop", ""),
    "65-hub-500": (f"{CPU_API} --model {QWEN}", hub(8065), 3, "loop", f"{HELPER} 8065 500"),
    "66-hub-connection-reset": (
        f"{CPU_API} --model {QWEN}", hub(8066), 3, "loop", f"{HELPER} 8066 reset"),
    "67-hub-no-answer": (
        f"{CPU_API} --model {QWEN}",
        hub(8067, "\nEnvironment=HF_HUB_ETAG_TIMEOUT=5\nEnvironment=HF_HUB_DOWNLOAD_TIMEOUT=5"),
        3, "loop", f"{HELPER} 8067 hang"),
    "68-hub-repo-not-found": (
        f"{CPU_API} --model {QWEN}", hub(8068), 3, "loop", f"{HELPER} 8068 repo-not-found"),
    "69-main-sigkill-serving": (
        f"{CPU_API} --model {TINY} --port 8069 --max-model-len 256", LOOP, 2,
        "serve-kill:9:8069", ""),
    "70-main-sigterm-serving": (
        f"{CPU_API} --model {TINY} --port 8070 --max-model-len 256", LOOP, 2,
        "serve-kill:15:8070", ""),
    "71-enginecore-sigterm-serving": (
        f"{CPU_API} --model {TINY} --port 8071 --max-model-len 256", LOOP, 2,
        "serve-kill:15:8071:VLLM::EngineCor", ""),
}
b2.SCENARIOS.update(SCENARIOS)  # b2.unit_text reads ONLINE from its table
b2.ONLINE.update(n for n, s in SCENARIOS.items() if s[1].startswith(HUB))
LOOP_TIMEOUT_S = 200


def kill_main_serving(box: rs.Container, unit: str, sig: int, port: int, invocations: int,
                      notes: list[str], target: str = "") -> None:
    """Serve, answer one completion, then send `sig` to the unit's main process, or to the
    first process whose comm starts with `target` (from outside systemd: no stop job),
    `invocations` times."""
    body = json.dumps({"model": TINY, "prompt": "def hello", "max_tokens": 8})
    box.systemctl("start", unit, check=False)
    for n in range(invocations):
        rs.wait_healthy(box, port, unit, timeout=300)
        r = rs.curl(box, f"http://127.0.0.1:{port}/v1/completions", body)
        notes.append(f"inv{n}: completion before kill: {r[-9:]!r}")
        s = state(box, unit)
        pid = str(rs.find_comm(box, target)[0]) if target else s["MainPID"]
        rs.kill_and_note(box, unit, pid, sig, target or "main", n, notes)
        rs.await_restart(box, unit, n, invocations)
    rs.stop_after_last(box, unit)


def loop_unless_serving(box: rs.Container, unit: str, invocations: int, port: int | None,
                        notes: list[str]) -> None:
    """The loop driver, a start that serves stopped at once (run_scenarios.loop_until_failed)."""
    rs.loop_until_failed(box, unit, invocations, notes, port=port,
                         timeout=LOOP_TIMEOUT_S * invocations)


def port_of(cmd: str) -> int | None:
    words = cmd.split()
    return int(words[words.index("--port") + 1]) if "--port" in words else None


def _drive(box: rs.Container, unit: str, cmd: str, invocations: int, kind: str, helper: str,
           notes: list[str]) -> None:
    if kind == "loop":
        loop_unless_serving(box, unit, invocations, port_of(cmd), notes)
    elif kind.startswith("serve-kill:"):
        sig, port, *target = kind.removeprefix("serve-kill:").split(":", 2)
        kill_main_serving(box, unit, int(sig), int(port), invocations, notes,
                          target[0] if target else "")


def main() -> None:
    b2.run_batch(SCENARIOS, _drive)


if __name__ == "__main__":
    main()


# The label of each scenario, written before any was recorded or scored (the reason: would the
# same unit file, restarted on the same machine, crash the same way?).
LABELS: dict[str, tuple[str, str]] = {
    "50-speculative-config-bad-json": ("fatal", "a flag's JSON value does not parse"),
    "51-hf-overrides-not-json": ("fatal", "a flag's JSON value does not parse"),
    "52-served-model-name-empty-env": (
        "fatal", "the unit passes an unset variable; its environment is the same at restart"),
    "53-max-num-seqs-zero": ("fatal", "a flag's value is out of range"),
    "54-max-lora-rank-not-a-choice": ("fatal", "a flag's value is not one of its choices"),
    "55-load-format-unknown": ("fatal", "a flag names a load format that does not exist"),
    "56-tokenizer-mode-unknown": ("fatal", "a flag names a tokenizer mode that does not exist"),
    "57-heads-not-dividing-hidden-size": ("fatal", "the model's config.json is inconsistent"),
    "58-config-without-architectures": ("fatal", "the model's config.json lacks a field"),
    "59-tokenizer-config-truncated": ("fatal", "a file of the model is not valid JSON"),
    "60-remote-code-import-error": (
        "fatal", "the model's own code imports a package this venv does not have"),
    "61-omp-bind-cores-missing": (
        "fatal", "the unit binds threads to CPUs this machine does not have"),
    "62-chat-template-syntax-error": ("fatal", "the chat template given on the command line "
                                      "does not compile"),
    "63-block-size-7": ("fatal", "a flag's value the CPU attention backend cannot use"),
    "64-pipeline-parallel-2-cpu": ("fatal", "a capability this machine lacks"),
    "65-hub-500": ("transient", "the hub's server error; the next start may find it well"),
    "66-hub-connection-reset": ("transient", "the network or the hub dropped the connection"),
    "67-hub-no-answer": ("transient", "the hub did not answer in time"),
    "68-hub-repo-not-found": (
        "fatal", "the hub says the model id names no repository; it says so again at restart"),
    "69-main-sigkill-serving": (
        "transient", "a kill from outside systemd (a person, the OOM killer's stand-in)"),
    "70-main-sigterm-serving": (
        "transient", "a person's kill outside systemd; the next start serves"),
    # added after the first sixteen were scored, labelled before it was recorded
    "71-enginecore-sigterm-serving": (
        "transient", "a person's kill of the engine process outside systemd; the next start "
        "serves"),
}
