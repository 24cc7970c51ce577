"""Real SGLang start-up failures under systemd 252 in systemd-nspawn, batch 2 (hold-out,
scenarios 17-...). Reuses run_sglang.py (batch 1's driver: unit template, put_unit, save, ...).

Usage: python3 -B run_sglang2.py OUTDIR SCENARIO...   (names from SCENARIOS below)
One booted_container() per call; units `sglang-NN-slug.service`, ports 18230-18244 (SGLang),
18250 (the hub stand-in, run on the host by this driver and killed by its PID).
Env DEADLINE_EPOCH: no scenario is started after it, and loops are cut at it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.dont_write_bytecode = True  # the recording wrote nothing into the repository
sys.path.insert(0, str(Path(__file__).resolve().parent))
import run_sglang as b1  # noqa: E402  (batch 1's driver, copied; imports nspawn/run_scenarios)
from run_sglang import CPU, KV, M, ROOT, G, srv  # noqa: E402
from nspawn import Container, booted_container, wait_for  # noqa: E402
from run_scenarios import curl, failures, log, state  # noqa: E402

HERE = Path(__file__).resolve().parent
QWEN = "Qwen/Qwen2.5-0.5B-Instruct"
EMPTY = "Environment=HF_HOME=/var/tmp/hf-empty"
HUB_PORT = 18250
DEADLINE = float(os.environ.get("DEADLINE_EPOCH", "0")) or None

# name -> (ExecStart, extra [Service] lines, invocations, kind, helper ExecStart or "")
SCENARIOS: dict[str, tuple[str, str, int, str, str]] = {
    "17-chat-template-missing": (
        srv(G, 18230, CPU, KV, "--chat-template /nonexistent/template.jinja"), "", 3, "loop", ""),
    "18-tool-call-parser-unknown": (
        srv(G, 18231, CPU, KV, "--tool-call-parser nope"), "", 3, "loop", ""),
    "19-reasoning-parser-unknown": (
        srv(G, 18232, CPU, KV, "--reasoning-parser nope"), "", 3, "loop", ""),
    "20-context-length-beyond-model": (
        srv(G, 18233, CPU, KV, "--context-length 100000"), "", 3, "loop", ""),
    "21-tokenizer-path-missing": (
        srv(G, 18234, CPU, KV, "--tokenizer-path /nonexistent/tok"), "", 3, "loop", ""),
    "22-tokenizer-files-missing": (srv(f"{M}/tiny-gpt2-notok", 18235, CPU, KV), "", 3, "loop", ""),
    "23-weights-file-missing": (srv(f"{M}/tiny-gpt2-noweights", 18236, CPU, KV), "", 3, "loop",
                                ""),
    "24-model-type-unknown": (srv(f"{M}/tiny-gpt2-tinyfoo", 18237, CPU, KV), "", 3, "loop", ""),
    "25-tokenizer-json-truncated": (srv(f"{M}/tiny-gpt2-tokhalf", 18238, CPU, KV), "", 3, "loop",
                                    ""),
    "26-lora-path-missing": (
        srv(G, 18239, CPU, KV, "--lora-paths bad=/nonexistent/lora"), "", 3, "loop", ""),
    "27-limit-nofile-16": (srv(G, 18240, CPU, KV), "LimitNOFILE=16", 3, "loop", ""),
    "28-host-address-not-local": (
        srv(G, 18241, CPU, KV).replace("--host 127.0.0.1", "--host 10.255.255.1"), "", 3, "loop",
        ""),
    # Hub: no HF_HUB_OFFLINE (NO_OFFLINE), empty HF_HOME, a model id never cached.
    "29-hub-connection-refused": (
        srv(QWEN, 18242, CPU, KV), EMPTY + "\nEnvironment=HF_ENDPOINT=http://127.0.0.1:9", 3,
        "loop", ""),
    "30-hub-429": (
        srv(QWEN, 18243, CPU, KV), EMPTY + f"\nEnvironment=HF_ENDPOINT=http://127.0.0.1:{HUB_PORT}",
        3, "loop+hub:429", ""),
    # a blocker unit holds the port for the first 2 starts only, then is stopped
    "31-port-held-first-two-starts": (
        srv(G, 18244, CPU, KV), "", 3, "loop-release:2",
        "/usr/bin/python3 -m http.server 18244 --bind 127.0.0.1"),
}
NO_OFFLINE = {"29-hub-connection-refused", "30-hub-429"}
PER_INV_S = {"30-hub-429": 300, "31-port-held-first-two-starts": 300,
             "28-host-address-not-local": 300}

# Each scenario's label, the cause line expected, and why; all written BEFORE any of these
# scenarios was run (no host trial of any of them): would the same unit, restarted on the same
# machine, fail the same way?
LABELS: dict[str, tuple[str, str, str]] = {
    "17-chat-template-missing": (
        "fatal", "an error naming /nonexistent/template.jinja as not found (FileNotFoundError or "
        "a ValueError that the chat template is unknown)",
        "the unit names a chat template file that does not exist; no restart creates it"),
    "18-tool-call-parser-unknown": (
        "fatal", "argparse `argument --tool-call-parser: invalid choice: 'nope'` (exit 2), or a "
        "ValueError listing the supported parsers",
        "the unit names a tool-call parser SGLang does not have; same at every start"),
    "19-reasoning-parser-unknown": (
        "fatal", "argparse `argument --reasoning-parser: invalid choice: 'nope'` (exit 2), or a "
        "ValueError listing the supported parsers",
        "the unit names a reasoning parser SGLang does not have; same at every start"),
    "20-context-length-beyond-model": (
        "fatal", "ValueError: User-specified context_length (100000) is greater than the derived "
        "context_length (512) ...",
        "the configured context is longer than the model's 512 positions; a config error, same "
        "at restart"),
    "21-tokenizer-path-missing": (
        "fatal", "OSError / HFValidationError: Repo id must be in the form ...: "
        "'/nonexistent/tok' (the missing path taken as a hub id, as 02)",
        "the unit names a tokenizer directory that does not exist"),
    "22-tokenizer-files-missing": (
        "fatal", "an OSError/ValueError that no tokenizer can be loaded from the model "
        "directory (Can't load tokenizer for ...)",
        "the model directory on disk has no tokenizer files; no restart adds them"),
    "23-weights-file-missing": (
        "fatal", "RuntimeError: Cannot find any model weights with `.../tiny-gpt2-noweights`",
        "the model directory on disk has no weights file"),
    "24-model-type-unknown": (
        "fatal", "ValueError: The checkpoint you are trying to load has model type `tinyfoo` but "
        "Transformers does not recognize this architecture",
        "config.json names a model type no installed library knows; same at every start"),
    "25-tokenizer-json-truncated": (
        "fatal", "tokenizers' `Exception: EOF while parsing ...` (tokenizer.json not valid "
        "JSON), possibly re-raised as a transformers error",
        "the tokenizer file on disk is cut in half"),
    "26-lora-path-missing": (
        "fatal", "an error that the LoRA adapter path /nonexistent/lora does not exist (or a "
        "Repo id error naming it; or LoRA unsupported on CPU)",
        "the unit names a LoRA adapter that does not exist; same at every start"),
    "27-limit-nofile-16": (
        "fatal", "OSError: [Errno 24] Too many open files",
        "the unit's own limit of 16 open files is far below what the server needs; the same "
        "limit applies at every restart"),
    "28-host-address-not-local": (
        "fatal", "uvicorn: [Errno 99] error while attempting to bind on address "
        "('10.255.255.1', 18241): cannot assign requested address",
        "the unit binds an address this host does not have; no restart gives it one"),
    "29-hub-connection-refused": (
        "transient", "a connection error to the hub: `Connection refused` / "
        "`We couldn't connect to 'http://127.0.0.1:9' to load the files`",
        "the model hub is unreachable (network/peer); once it answers again the same unit "
        "downloads the model and starts"),
    "30-hub-429": (
        "transient", "`429 Client Error: Too Many Requests for url: http://127.0.0.1:18250/...`",
        "the hub rate-limits this client; a later restart (after the limit window) fetches "
        "the model"),
    "31-port-held-first-two-starts": (
        "transient", "uvicorn: [Errno 98] error while attempting to bind on address "
        "('127.0.0.1', 18244): address already in use",
        "another process holds the port for a while; once it lets go, a restart binds and "
        "serves (here it does: the holder stops after the 2nd failed start)"),
}


def remaining() -> float:
    return (DEADLINE - time.time()) if DEADLINE else 1e9


def install(box: Container, name: str, cmd: str, extra: str) -> str:
    unit = b1.put_unit(box, name, cmd, extra)
    if name in NO_OFFLINE:
        path = f"/etc/systemd/system/{unit}"
        text = b1.UNIT.format(name=name, cmd=cmd, extra=extra).replace(
            "Environment=HF_HUB_OFFLINE=1\n", "")
        box.write_file(path, text)
        box.systemctl("daemon-reload")
    return unit


def loop_release(box: Container, unit: str, helper_unit: str, held: int, invocations: int,
                 port: int, notes: list[str], timeout: float) -> None:
    """Start with the holder up; after `held` failed runs stop the holder; stop the unit once
    `invocations` runs ended or a start serves."""
    box.systemctl("start", unit, check=False)
    deadline = time.monotonic() + timeout
    released = False
    try:
        while time.monotonic() < deadline:
            n = failures(box, unit)
            if not released and n >= held:
                box.systemctl("stop", helper_unit, check=False)
                released = True
                notes.append(f"holder stopped after {n} failed runs at "
                             + time.strftime("%H:%M:%S"))
            s = state(box, unit)
            if s["SubState"] == "auto-restart" and n >= invocations:
                return
            if released and s["SubState"] == "running" and "HTTP 200" in curl(
                    box, f"http://127.0.0.1:{port}/health", timeout=3):
                notes.append(f"SERVED after the holder left, NRestarts {s['NRestarts']}, at "
                             + time.strftime("%H:%M:%S"))
                time.sleep(2)
                return
            time.sleep(0.5)
        notes.append("driver: timed out (or deadline)")
    finally:
        box.systemctl("stop", unit, check=False)


def main() -> None:
    signal.signal(signal.SIGTERM, b1._stop)
    out = Path(sys.argv[1])
    names = sys.argv[2:]
    (out / "work").mkdir(parents=True, exist_ok=True)
    with booted_container([(ROOT, ROOT)], workdir=out / "work") as box:
        log(f"container up, leader {box.leader}")
        for name in names:
            if remaining() < 90:
                log(f"{name}: NOT RUN (deadline)")
                continue
            cmd, extra, invocations, kind, helper = SCENARIOS[name]
            unit = install(box, name, cmd, extra)
            (out / "work" / f"{name}.unit").write_text(
                box.run("systemctl", "cat", unit, check=False).stdout)
            notes: list[str] = []
            t0 = time.monotonic()
            helper_unit = None
            hub: subprocess.Popen | None = None
            timeout = min(PER_INV_S.get(name, 240) * invocations, remaining() - 30)
            try:
                if helper:
                    helper_unit = b1.put_unit(box, f"{name}-holder", helper, "", "helper")
                    box.systemctl("start", helper_unit)
                    time.sleep(2)
                    notes.append("holder: " + curl(box, f"http://127.0.0.1:{b1.port_of(cmd)}/",
                                                   timeout=5)[-8:])
                if kind.startswith("loop+hub:"):
                    mode = kind.removeprefix("loop+hub:")
                    hub = subprocess.Popen(
                        [sys.executable, "-B", str(HERE / "hub_stand_in.py"), str(HUB_PORT),
                         mode], stdout=open(out / "work" / f"{name}.hub.log", "wb"),
                        stderr=subprocess.STDOUT)
                    time.sleep(1.5)
                    notes.append(f"hub stand-in ({mode}) pid {hub.pid}: "
                                 + curl(box, f"http://127.0.0.1:{HUB_PORT}/api/models/x",
                                        timeout=5)[-8:])
                if kind == "loop" or kind.startswith("loop+hub:"):
                    b1.loop_until_failed(box, unit, invocations, notes, port=b1.port_of(cmd),
                                         timeout=timeout)
                elif kind.startswith("loop-release:"):
                    loop_release(box, unit, helper_unit, int(kind.split(":")[1]), invocations,
                                 b1.port_of(cmd), notes, timeout)
            except Exception as exc:  # keep going: save what happened
                notes.append(f"driver: {type(exc).__name__}: {exc}")
                box.systemctl("stop", unit, check=False)
            finally:
                if helper_unit:
                    box.systemctl("stop", helper_unit, check=False)
                if hub is not None:
                    os.kill(hub.pid, signal.SIGTERM)
                    hub.wait(timeout=10)
                    notes.append(f"hub stand-in pid {hub.pid} killed")
            b1.save(box, unit, out, name, notes, t0)
    log("container down")


if __name__ == "__main__":
    main()
