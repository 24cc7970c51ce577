"""Real SGLang start-up failures under systemd 252 in systemd-nspawn (corpus rows 360-...).

Usage: python3 run_sglang.py OUTDIR SCENARIO...   (names from SCENARIOS below)
Boots the host's own OS tree with tests/e2e/nspawn.py's booted_container() (read-only bind of
/var/tmp/sglang-real at the same path), puts in one unit per scenario, drives it, saves its
journal (export, per-invocation text) and powers the container off. Adapted from
tests/data/journals/real-vllm/tools/run_scenarios.py and run_batch3.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("NSPAWN_DIR", str(Path(__file__).resolve().parents[4] / "e2e")))
from nspawn import Container, booted_container, wait_for  # noqa: E402

# The vLLM batches' driver: its log line, unit state, curl and loop driver
# (real-vllm/tools/run_scenarios.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "real-vllm" / "tools"))
from run_scenarios import UNIT as VLLM_UNIT  # noqa: E402
from run_scenarios import curl, kill_and_note, log, loop_until_failed, state  # noqa: E402

ROOT = os.environ.get("SGLANG_REAL_ROOT", "/var/tmp/sglang-real")
PY = f"{ROOT}/venv/bin/python"
SGL = f"{PY} -m sglang.launch_server"
M = f"{ROOT}/models"
TINY = f"{M}/tiny"
G = f"{M}/tiny-gpt2"  # make_tiny_gpt2.py
CPU = "--device cpu"
KV = "--max-total-tokens 4096"  # else the CPU KV cache takes 0.716 of RAM (14 GB, 29 s)

UNIT = VLLM_UNIT.replace("vLLM server", "SGLang server")  # the vLLM batches' unit


def srv(model: str, port: int, *more: str) -> str:
    return " ".join([SGL, "--model-path", model, "--host 127.0.0.1 --port", str(port), *more])


# name -> (ExecStart, extra [Service] lines, invocations, kind, helper ExecStart or "")
# TINY (Llama) for the default CUDA path; G (tiny GPT-2) with --device cpu elsewhere: on this
# host SGLang's CPU path can build no RoPE model (it wants vllm's kernel: scenario 13), while
# the GPT-2 loads and serves, so each scenario fails for its own reason.
SCENARIOS: dict[str, tuple[str, str, int, str, str]] = {
    "01-cuda-default-no-gpu": (srv(TINY, 18201), "", 3, "loop", ""),
    "02-model-path-missing": (srv("/models/nope", 18202, CPU), "", 3, "loop", ""),
    "03-cli-unknown-flag": (srv(G, 18203, CPU, "--foo"), "", 3, "loop", ""),
    "04-tp-size-not-an-int": (srv(G, 18204, CPU, "--tp-size abc"), "", 3, "loop", ""),
    "05-dtype-invalid": (srv(G, 18205, CPU, "--dtype float13"), "", 3, "loop", ""),
    "06-tp-size-3-cpu": (srv(G, 18206, CPU, KV, "--tp-size 3"), "", 3, "loop", ""),
    "07-corrupt-safetensors": (srv(f"{M}/tiny-gpt2-corrupt", 18207, CPU, KV), "", 3, "loop", ""),
    "08-config-json-truncated": (srv(f"{M}/tiny-gpt2-badjson", 18208, CPU, KV), "", 3, "loop",
                                 ""),
    "09-port-held-by-other-unit": (
        srv(G, 18209, CPU, KV), "", 3, "loop",
        "/usr/bin/python3 -m http.server 18209 --bind 127.0.0.1"),
    "10-main-sigkill-during-load": (srv(G, 18210, CPU, KV), "", 3, "kill-load:main:9", ""),
    "11-scheduler-sigkill-serving": (srv(G, 18211, CPU, KV), "", 3, "kill-serve:sglang::sch:9",
                                     ""),
    "12-main-sigkill-serving": (srv(G, 18212, CPU, KV), "", 3, "kill-serve:main:9", ""),
    "13-cpu-device-rope-needs-vllm": (srv(TINY, 18213, CPU, KV), "", 3, "loop", ""),
    "14-scheduler-sigkill-during-load": (srv(G, 18214, CPU, KV), "", 3,
                                         "kill-load:sglang::sch:9", ""),
    "15-detokenizer-sigkill-serving": (srv(G, 18215, CPU, KV), "", 3,
                                       "kill-serve:sglang::det:9", ""),
    "16-model-not-cached-offline": (srv("Qwen/Qwen2.5-0.5B-Instruct", 18216, CPU, KV),
                                    "Environment=HF_HOME=/var/tmp/hf-empty", 3, "loop", ""),
}

# The label of each scenario and its reason, written before any was recorded (would the same
# unit file, restarted on the same machine, crash the same way?).
LABELS: dict[str, tuple[str, str]] = {
    "01-cuda-default-no-gpu": ("fatal", "the host has no CUDA device; no restart gives it one"),
    "02-model-path-missing": ("fatal", "the unit names a model directory that does not exist"),
    "03-cli-unknown-flag": ("fatal", "the unit passes a flag SGLang does not know"),
    "04-tp-size-not-an-int": ("fatal", "a flag's value does not parse"),
    "05-dtype-invalid": ("fatal", "a flag's value is not one of its choices"),
    "06-tp-size-3-cpu": (
        "fatal", "tp 3 cannot split 4 heads, and the CPU has no 3 devices; same at restart"),
    "07-corrupt-safetensors": ("fatal", "the weights file on disk is truncated"),
    "08-config-json-truncated": ("fatal", "the model's config.json is not valid JSON"),
    "09-port-held-by-other-unit": (
        "either", "while the other unit holds the port every restart fails the same (fatal in "
        "effect), but the holder may leave and the next start serve; the journal of the "
        "failing unit cannot tell which"),
    "10-main-sigkill-during-load": (
        "transient", "a kill from outside systemd (the OOM killer's stand-in); the next start "
        "loads"),
    "11-scheduler-sigkill-serving": (
        "transient", "a kill of the scheduler child from outside systemd; the next start serves"),
    "12-main-sigkill-serving": (
        "transient", "a kill of the main process from outside systemd; the next start serves"),
    # added after the host trial of the CPU path, labelled before it was recorded
    "13-cpu-device-rope-needs-vllm": (
        "fatal", "the installed packages cannot build this model on the CPU; same at restart"),
    # added after the first thirteen were recorded, labelled before these were run
    "14-scheduler-sigkill-during-load": (
        "transient", "a kill of the scheduler child from outside systemd while it loads; the "
        "next start loads"),
    "15-detokenizer-sigkill-serving": (
        "transient", "a kill of the detokenizer child from outside systemd; the next start "
        "serves"),
    "16-model-not-cached-offline": (
        "fatal", "the unit says offline and the model id is in no cache; no restart fetches it"),
}


def put_unit(box: Container, name: str, cmd: str, extra: str, prefix: str = "sglang") -> str:
    unit = f"{prefix}-{name}.service"
    box.write_file(f"/etc/systemd/system/{unit}", UNIT.format(name=name, cmd=cmd, extra=extra))
    box.systemctl("daemon-reload")
    return unit


def find_comm(box: Container, prefix: str, parent: str | None = None) -> int | None:
    out = box.run("ps", "-eo", "pid,ppid,comm", "--no-headers", check=False).stdout
    for line in out.splitlines():
        pid, ppid, comm = line.split(None, 2)
        if comm.startswith(prefix) and (parent is None or ppid == parent):
            return int(pid)
    return None


def port_of(cmd: str) -> int:
    words = cmd.split()
    return int(words[words.index("--port") + 1])


def loop(box: Container, unit: str, invocations: int, port: int, notes: list[str],
         per_inv_s: float = 240) -> None:
    """Start; stop once `invocations` runs have ended, or at once if a start serves. (Recorded
    with a driver of its own that waited for NRestarts and the last run seen begin; the shared
    one waits for PID 1's `Failed with result` lines.)"""
    loop_until_failed(box, unit, invocations, notes, port=port, timeout=per_inv_s * invocations)


def wait_healthy(box: Container, port: int, unit: str, timeout: float = 400) -> None:
    def ok() -> bool:
        if state(box, unit)["ActiveState"] != "active":
            return False
        return "HTTP 200" in curl(box, f"http://127.0.0.1:{port}/health", timeout=3)
    wait_for(ok, timeout=timeout, what=f"{unit} healthy", interval=1.0)


def await_next(box: Container, unit: str, n: int, invocations: int) -> None:
    if n < invocations - 1:
        wait_for(lambda: state(box, unit)["SubState"] in ("running", "start"), timeout=30,
                 what="restart", interval=0.2)
    else:
        try:
            wait_for(lambda: state(box, unit)["SubState"] == "auto-restart", timeout=60,
                     what="auto-restart", interval=0.1)
        finally:
            box.systemctl("stop", unit, check=False)


def target_pid(box: Container, unit: str, target: str) -> int:
    s = state(box, unit)
    if target == "main":
        return int(s["MainPID"])
    return wait_for(lambda: find_comm(box, target), timeout=120, what=target, interval=0.2)


def kill_during_load(box: Container, unit: str, target: str, sig: int, invocations: int,
                     notes: list[str]) -> None:
    """`sig` to the target as soon as the scheduler process has its name (polled every
    0.2 s): the scheduler then loads the weights and sets up its KV cache, ~2 s here."""
    box.systemctl("start", unit, check=False)
    for n in range(invocations):
        wait_for(lambda: find_comm(box, "sglang::sch"), timeout=200, what="scheduler process",
                 interval=0.2)
        s = state(box, unit)
        pid = target_pid(box, unit, target)
        kill_and_note(box, unit, pid, sig, target, n, notes)
        await_next(box, unit, n, invocations)


def kill_serving(box: Container, unit: str, target: str, sig: int, port: int,
                 invocations: int, notes: list[str]) -> None:
    """Serve, answer one completion, then `sig` to the target from outside systemd."""
    body = json.dumps({"model": TINY, "prompt": "def hello", "max_tokens": 8})
    box.systemctl("start", unit, check=False)
    for n in range(invocations):
        wait_healthy(box, port, unit)
        r = curl(box, f"http://127.0.0.1:{port}/v1/completions", body)
        notes.append(f"inv{n}: completion before kill: {r[-9:]!r}")
        s = state(box, unit)
        pid = target_pid(box, unit, target)
        box.run("kill", f"-{sig}", str(pid), check=False)
        notes.append(f"inv{n}: kill -{sig} {target} pid {pid} (MainPID {s['MainPID']}) at "
                     + time.strftime("%H:%M:%S"))
        try:
            wait_for(lambda: state(box, unit)["MainPID"] != s["MainPID"], timeout=90,
                     what="main process to end", interval=0.2)
        except TimeoutError:
            r = curl(box, f"http://127.0.0.1:{port}/v1/completions", body, timeout=20)
            notes.append(f"inv{n}: STILL UP 90 s after the kill; a request: {r[-200:]!r}; "
                         "stopping")
            box.systemctl("stop", unit, check=False)
            return
        notes.append(f"inv{n}: after: {state(box, unit)}")
        await_next(box, unit, n, invocations)


def journal_bytes(box: Container, *args: str) -> bytes:
    return subprocess.run(["nsenter", "-t", str(box.leader), "-a", "journalctl", "--no-pager",
                           *args], capture_output=True, check=True, timeout=120).stdout


def save(box: Container, unit: str, out: Path, name: str, notes: list[str], t0: float) -> None:
    (out / f"{name}.export").write_bytes(journal_bytes(box, "-u", unit, "-o", "export", "--all"))
    (out / "work" / f"{name}.all.short").write_bytes(
        journal_bytes(box, "-u", unit, "-o", "short-precise", "--all"))
    entries = box.journal("-u", unit)
    ids: list[str] = []
    for e in entries:
        inv = e.get("_SYSTEMD_INVOCATION_ID")
        if inv and inv not in ids:
            ids.append(inv)
    info: dict = {"unit": unit, "invocations": ids, "notes": notes,
                  "elapsed_s": round(time.monotonic() - t0, 1)}
    if ids:
        (out / f"{name}.log").write_bytes(
            journal_bytes(box, f"_SYSTEMD_INVOCATION_ID={ids[0]}", "-o", "cat", "--all"))
        info["lines_per_invocation"] = [
            journal_bytes(box, f"_SYSTEMD_INVOCATION_ID={i}", "-o", "cat", "--all").count(b"\n")
            for i in ids]
    info["pid1"] = [{k: e.get(k) for k in ("MESSAGE", "MESSAGE_ID", "EXIT_CODE", "EXIT_STATUS",
                                           "INVOCATION_ID")}
                    for e in entries if e.get("_PID") == "1"]
    (out / "work" / f"{name}.info.json").write_text(json.dumps(info, indent=1))
    log(f"{name}: {len(ids)} invocations {info.get('lines_per_invocation')}, "
        f"{info['elapsed_s']}s; " + "; ".join(notes)[:1500])
    for e in info["pid1"]:
        if "exited" in (e["MESSAGE"] or "") or "Deactivated" in (e["MESSAGE"] or ""):
            log(f"   {e['MESSAGE']}")


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so the container is powered off and its cgroups removed


def main() -> None:
    signal.signal(signal.SIGTERM, _stop)
    out = Path(sys.argv[1])
    names = sys.argv[2:]
    (out / "work").mkdir(parents=True, exist_ok=True)
    with booted_container([(ROOT, ROOT)], workdir=out / "work") as box:
        log(f"container up, leader {box.leader}")
        for name in names:
            cmd, extra, invocations, kind, helper = SCENARIOS[name]
            unit = put_unit(box, name, cmd, extra)
            (out / "work" / f"{name}.unit").write_text(
                box.run("systemctl", "cat", unit, check=False).stdout)
            notes: list[str] = []
            t0 = time.monotonic()
            helper_unit = None
            try:
                if helper:
                    helper_unit = put_unit(box, f"{name}-holder", helper, "", "helper")
                    box.systemctl("start", helper_unit)
                    time.sleep(2)
                    notes.append("holder: " + curl(box, f"http://127.0.0.1:{port_of(cmd)}/",
                                                   timeout=5)[-8:])
                if kind == "loop":
                    loop(box, unit, invocations, port_of(cmd), notes)
                elif kind.startswith("kill-load:"):
                    target, sig = kind.removeprefix("kill-load:").rsplit(":", 1)
                    kill_during_load(box, unit, target, int(sig), invocations, notes)
                elif kind.startswith("kill-serve:"):
                    target, sig = kind.removeprefix("kill-serve:").rsplit(":", 1)
                    kill_serving(box, unit, target, int(sig), port_of(cmd), invocations, notes)
            except Exception as exc:  # keep going: save what happened
                notes.append(f"driver: {type(exc).__name__}: {exc}")
                box.systemctl("stop", unit, check=False)
            finally:
                if helper_unit:
                    box.systemctl("stop", helper_unit, check=False)
            save(box, unit, out, name, notes, t0)
    log("container down")


if __name__ == "__main__":
    main()
