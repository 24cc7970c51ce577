"""Batch 4 of real vLLM failures under systemd 252 in systemd-nspawn (scenarios 72-87): hold-outs.

Usage: VLLM_REAL_ROOT=/var/tmp/vllm-venv python3 run_batch4.py OUTDIR SCENARIO...
Reuses run_scenarios.py (the container, the unit template, `save`), run_batch2.py (the unit
writer, run_batch) and run_batch3.py (the loop driver that stops a start that serves).
New here: a port held for the first two starts (released before the third, which serves).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_batch2 as b2  # noqa: E402
import run_batch3 as b3  # noqa: E402
import run_scenarios as rs  # noqa: E402
from run_scenarios import LOOP, ROOT, TINY, state, wait_for  # noqa: E402

CPU_API = b2.CPU_API  # with --gpu-memory-utilization 0.5 (this host's memory is shared)
M = f"{ROOT}/models"
QWEN = b2.QWEN
HELPER = b2.HELPER  # /usr/bin/python3 ROOT/tools/hub_stand_in.py


def api(port: int, rest: str, model: str = TINY, mml: str = "--max-model-len 256") -> str:
    return f"{CPU_API} --model {model} {mml} --port {port} {rest}".rstrip()


# name -> (ExecStart, extra [Service] lines, invocations, kind, helper ExecStart or "")
SCENARIOS: dict[str, tuple[str, str, int, str, str]] = {
    "72-chat-template-file-missing": (
        api(8272, "--chat-template /nonexistent/template.jinja"), LOOP, 3, "loop", ""),
    "73-tool-call-parser-unknown": (
        api(8273, "--enable-auto-tool-choice --tool-call-parser nope"), LOOP, 3, "loop", ""),
    "74-reasoning-parser-unknown": (api(8274, "--reasoning-parser nope"), LOOP, 3, "loop", ""),
    "75-lora-module-path-missing": (
        api(8275, "--enable-lora --lora-modules bad=/nonexistent/lora"), LOOP, 3, "loop", ""),
    "76-batched-tokens-below-model-len": (
        api(8276, "--max-num-batched-tokens 16", mml="--max-model-len 256"), LOOP, 3, "loop", ""),
    "77-pipeline-parallel-2-cpu": (api(8277, "--pipeline-parallel-size 2"), LOOP, 3, "loop", ""),
    "78-ssl-files-missing": (
        api(8278, "--ssl-keyfile /nonexistent/key.pem --ssl-certfile /nonexistent/cert.pem"),
        LOOP, 3, "loop", ""),
    "79-model-type-unknown": (api(8279, "", model=f"{M}/tiny-modeltype"), LOOP, 3, "loop", ""),
    "80-tokenizer-json-truncated": (
        api(8280, "", model=f"{M}/tiny-tokjson-half"), LOOP, 3, "loop", ""),
    "81-weights-missing-a-layer": (
        api(8281, "", model=f"{M}/tiny-1layer-weights"), LOOP, 3, "loop", ""),
    "82-remote-config-syntax-error": (
        api(8282, "--trust-remote-code", model=f"{M}/tiny-remote-syntaxerror"), LOOP, 3, "loop",
        ""),
    "83-nofile-limit-16": (api(8283, ""), LOOP + "\nLimitNOFILE=16", 3, "loop", ""),
    "84-speculative-ngram-no-num-tokens": (
        api(8284, "--speculative-config '{\"method\": \"ngram\"}'"), LOOP, 3, "loop", ""),
    "85-hub-no-answer-short-timeouts": (
        f"{CPU_API} --model {QWEN}",
        b3.hub(8290, "\nEnvironment=HF_HUB_ETAG_TIMEOUT=3\nEnvironment=HF_HUB_DOWNLOAD_TIMEOUT=3"),
        3, "loop", f"{HELPER} 8290 hang-files"),  # host trial: `hang` hangs forever (67)
    # added after 76 served (chunked prefill, on by default, lets 16 < 256 pass): the same
    # contradiction with chunked prefill turned off; labelled before it was run
    "87-batched-tokens-below-model-len-no-chunking": (
        api(8287, "--max-num-batched-tokens 16 --no-enable-chunked-prefill"), LOOP, 3, "loop", ""),
    "86-port-held-two-starts": (
        api(8286, ""), LOOP, 3, "port-held:2",
        "/usr/bin/python3 -m http.server 8286 --bind 127.0.0.1"),
}
b2.SCENARIOS.update(SCENARIOS)
b2.ONLINE.update(n for n, s in SCENARIOS.items() if s[1].startswith(b2.HUB))
LOOP_TIMEOUT_S = 200  # per invocation
TIMEOUT_S = {"85-hub-no-answer-short-timeouts": 540}  # per invocation (host trial: ~60 s per try)


def port_held(box: rs.Container, unit: str, port: int, held_for: int, blocker_cmd: str,
              notes: list[str]) -> None:
    """Another process holds the port for the first `held_for` starts; it is released before
    the next, which should serve; then the unit is stopped."""
    blocker = b2.put_unit(box, "port-holder", blocker_cmd, "")
    box.systemctl("start", blocker)
    time.sleep(2)
    notes.append("holder: " + rs.curl(box, f"http://127.0.0.1:{port}/", timeout=5)[-12:])
    box.systemctl("start", unit, check=False)
    try:
        wait_for(lambda: rs.failures(box, unit) >= held_for, timeout=LOOP_TIMEOUT_S * held_for,
                 what=f"{held_for} crashes", interval=0.1)
    finally:
        box.systemctl("stop", blocker, check=False)
    notes.append(f"holder stopped after crash {held_for} at " + time.strftime("%H:%M:%S")
                 + f"; unit {state(box, unit)}")
    try:
        rs.wait_healthy(box, port, unit, timeout=240)
        notes.append("served after the holder left: " + rs.curl(
            box, f"http://127.0.0.1:{port}/health", timeout=5)[-12:] + " at "
            + time.strftime("%H:%M:%S"))
    finally:
        box.systemctl("stop", unit, check=False)


def _drive(box: rs.Container, unit: str, cmd: str, invocations: int, kind: str, helper: str,
           notes: list[str]) -> None:
    name = unit.removeprefix("vllm-").removesuffix(".service")
    if kind == "loop":
        rs.loop_until_failed(box, unit, invocations, notes, port=b3.port_of(cmd),
                             timeout=TIMEOUT_S.get(name, LOOP_TIMEOUT_S) * invocations)
    elif kind.startswith("port-held:"):
        port_held(box, unit, b3.port_of(cmd), int(kind.split(":")[1]), helper, notes)


def main() -> None:
    b2.run_batch(SCENARIOS, _drive, helper_first=lambda kind: kind == "loop")


# The label of each scenario, written before any was recorded (severity: would the same unit
# file, restarted on the same machine, crash the same way?; then what the root-cause line is
# expected to contain; then the reason).
LABELS: dict[str, tuple[str, str, str]] = {
    "72-chat-template-file-missing": (
        "fatal", "appears path-like, but doesn't exist",
        "the unit names a chat template file that is not there"),
    "73-tool-call-parser-unknown": (
        "fatal", "invalid tool call parser: nope", "a flag names a parser that does not exist"),
    "74-reasoning-parser-unknown": (
        "fatal", "nope", "a flag names a reasoning parser that does not exist"),
    "75-lora-module-path-missing": (
        "fatal", "/nonexistent/lora", "a LoRA adapter path that does not exist"),
    "76-batched-tokens-below-model-len": (
        "fatal", "max_num_batched_tokens (16)", "flag values contradict each other"),
    "77-pipeline-parallel-2-cpu": (
        "fatal", "Not enough allowed NUMA nodes", "a capability this machine lacks"),
    "78-ssl-files-missing": (
        "fatal", "No such file or directory", "the unit names TLS files that are not there"),
    "79-model-type-unknown": (
        "fatal", "tinyfoo", "the model's config.json names a model type nobody knows"),
    "80-tokenizer-json-truncated": (
        "fatal", "EOF while parsing", "a file of the model is cut short"),
    "81-weights-missing-a-layer": (
        "fatal", "Following weights were not initialized from checkpoint",
        "the weights do not match the config (a layer's tensors are missing)"),
    "82-remote-config-syntax-error": (
        "fatal", "SyntaxError", "the model's own code does not compile"),
    "83-nofile-limit-16": (
        "fatal", "Too many open files", "the unit's file limit is too low for any start"),
    "84-speculative-ngram-no-num-tokens": (
        "fatal", "num_speculative_tokens", "a flag's JSON value lacks a required field"),
    "85-hub-no-answer-short-timeouts": (
        "transient", "timed out", "the hub did not answer in time; the next start may find it"),
    "86-port-held-two-starts": (
        "transient", "Address already in use",
        "another process held the port; once it left, a restart served"),
    # added after 76 served; labelled before 87 was run (on the host or in the container)
    "87-batched-tokens-below-model-len-no-chunking": (
        "fatal", "max_num_batched_tokens (16)", "flag values contradict each other"),
}


if __name__ == "__main__":
    main()
