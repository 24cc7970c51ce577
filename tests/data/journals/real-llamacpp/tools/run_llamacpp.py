"""Real start-up failures of llama.cpp's llama-server as systemd services in systemd-nspawn.

Usage: python3 run_llamacpp.py OUTDIR SCENARIO...   (names from SCENARIOS below)
The same recipe as real-vllm/tools/run_scenarios.py: booted_container() of vllm-supervisor's
tests/e2e/nspawn.py (the host's own OS tree, volatile, host /usr read-only), ROOT bound
read-only at the same path, one unit per scenario, Restart=always, 3 invocations each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.environ.get("NSPAWN_DIR", str(Path(__file__).resolve().parents[4] / "e2e")))
from nspawn import Container, booted_container, wait_for  # noqa: E402

# The vLLM batches' driver: its log line, unit state and curl (real-vllm/tools/run_scenarios.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "real-vllm" / "tools"))
from run_scenarios import curl, failures, log, loop_until_failed, state  # noqa: E402

ROOT = os.environ.get("LLAMACPP_REAL_ROOT", "/var/tmp/llamacpp-real")
SERVER = f"{ROOT}/bin/llama-server"
TINY = f"{ROOT}/models/tiny-f16.gguf"


def srv(port: int, *args: str, model: str = TINY) -> str:
    return " ".join([SERVER, "-m", model, "--host", "127.0.0.1", "--port", str(port), *args])


UNIT = """[Unit]
Description=llama.cpp server, real failure scenario {name}
StartLimitIntervalSec=0

[Service]
ExecStart={cmd}
Restart=always
RestartSec=2s
{extra}
"""

# name -> (ExecStart, extra [Service] lines, invocations, kind)
SCENARIOS: dict[str, tuple[str, str, int, str]] = {
    "01-model-file-missing": (srv(18101, model="/models/nope.gguf"), "", 3, "loop"),
    "02-gguf-truncated": (srv(18102, model=f"{ROOT}/models/tiny-truncated.gguf"), "", 3, "loop"),
    "03-not-a-gguf-safetensors": (
        srv(18103, model=f"{ROOT}/models/not-gguf.safetensors"), "", 3, "loop"),
    "04-cli-unknown-flag": (srv(18104, "--foo"), "", 3, "loop"),
    "05-cli-ctx-size-not-a-number": (srv(18105, "--ctx-size", "abc"), "", 3, "loop"),
    "06-port-in-use": (srv(18106), "", 3, "port:18106"),
    "07-lora-file-missing": (srv(18107, "--lora", "/models/nope-lora.gguf"), "", 3, "loop"),
    "08-chat-template-file-missing": (
        srv(18108, "--chat-template-file", "/nope.jinja"), "", 3, "loop"),
    "09-ctx-size-beyond-memory": (srv(18109, "--ctx-size", "CTX_HUGE"), "", 3, "loop"),
    "10-main-sigkill-serving": (srv(18110), "", 3, "serve-kill:18110"),
    "control-clean-stop": (srv(18111), "", 1, "stop:18111"),
    # second batch, same run recipe (labels below written before it ran)
    "11-model-permission-denied": (
        srv(18113, model=f"{ROOT}/models/tiny-private.gguf"), "User=nobody", 3, "loop"),
    "12-port-held-briefly": (srv(18112), "", 2, "port-brief:18112"),
    "13-architecture-unknown": (
        srv(18114, model=f"{ROOT}/models/tiny-arch-unknown.gguf"), "", 3, "loop"),
    "14-host-address-not-local": (
        f"{SERVER} -m {TINY} --host 10.255.255.1 --port 18115", "", 3, "loop"),
    "15-mmproj-file-missing": (srv(18116, "--mmproj", "/models/nope-mmproj.gguf"), "", 3, "loop"),
    "16-model-path-is-directory": (srv(18117, model=f"{ROOT}/models/hf"), "", 3, "loop"),
    "17-device-not-found": (srv(18118, "--device", "CUDA0"), "", 3, "loop"),
    # third batch
    "18-tensor-shape-mismatch": (
        srv(18119, model=f"{ROOT}/models/tiny-heads3.gguf"), "", 3, "loop"),
    "19-ggml-assert-batch-size-1": (srv(18120, "-b", "1", "-ub", "1"), "", 3, "loop"),
    "20-env-ctx-size-not-a-number": (srv(18121), "Environment=LLAMA_ARG_CTX_SIZE=abc", 3, "loop"),
    "21-ssl-not-built": (
        srv(18122, "--ssl-key-file", "/etc/llama/key.pem", "--ssl-cert-file",
            "/etc/llama/cert.pem"), "", 3, "loop"),
    "22-binary-missing": (
        f"/usr/local/bin/llama-server -m {TINY} --host 127.0.0.1 --port 18123", "", 3, "loop"),
    "control-main-sigterm-serving": (srv(18124), "", 2, "serve-kill:18124:15"),
}

# Written before any of these logs was recorded or scored. (label, one-line reason)
LABELS: dict[str, tuple[str, str]] = {
    "01-model-file-missing": (
        "fatal", "the -m path names no file; every start fails the same until the unit changes"),
    "02-gguf-truncated": (
        "fatal", "the model file itself is damaged (cut short); a restart reads the same bytes"),
    "03-not-a-gguf-safetensors": (
        "fatal", "-m points at a file that is not GGUF (HF safetensors); a config mistake"),
    "04-cli-unknown-flag": ("fatal", "the command line has a flag the binary does not know"),
    "05-cli-ctx-size-not-a-number": (
        "fatal", "a flag value that cannot be parsed; the same at every start"),
    "06-port-in-use": (
        "either", "another unit holds the port for every start here: restarts fail while it "
        "holds it; they would succeed once it lets go, so it depends on the holder"),
    "07-lora-file-missing": (
        "fatal", "--lora names a file that does not exist; a config mistake"),
    "08-chat-template-file-missing": (
        "fatal", "--chat-template-file names a file that does not exist; a config mistake"),
    "09-ctx-size-beyond-memory": (
        "fatal", "the requested context needs more memory than the host has, every start"),
    "10-main-sigkill-serving": (
        "transient", "a kill -9 from outside (a person, the OOM killer's stand-in) of a server "
        "that was serving; the next start serves"),
    "control-clean-stop": ("none", "not a failure: systemctl stop of a healthy server"),
    "11-model-permission-denied": (
        "fatal", "the unit's user (nobody) cannot read the 0600 root-owned model file; the same "
        "at every start until permissions or User= change"),
    "12-port-held-briefly": (
        "transient", "another process held the port for the first start only; the next start "
        "serves"),
    "13-architecture-unknown": (
        "fatal", "the GGUF's architecture is one this llama.cpp build does not know; needs a "
        "newer build or another model"),
    "14-host-address-not-local": (
        "fatal", "--host names an address this machine does not have; a config mistake"),
    "15-mmproj-file-missing": ("fatal", "--mmproj names a file that does not exist"),
    "16-model-path-is-directory": (
        "fatal", "-m names a directory (an HF checkout), not a GGUF file"),
    "17-device-not-found": (
        "fatal", "--device names a GPU this CPU-only build/host does not have"),
    "18-tensor-shape-mismatch": (
        "fatal", "the GGUF's metadata (head count 3) does not match its weights; a broken "
        "conversion, the same at every start"),
    "19-ggml-assert-batch-size-1": (
        "fatal", "-b 1 -ub 1 trips an internal GGML_ASSERT (abort) while the context is made; "
        "config-triggered, the same at every start"),
    "20-env-ctx-size-not-a-number": (
        "fatal", "an Environment= line (LLAMA_ARG_CTX_SIZE=abc) that cannot be parsed"),
    "21-ssl-not-built": (
        "fatal", "SSL files asked of a build without SSL support; needs another build"),
    "22-binary-missing": (
        "fatal", "ExecStart names a binary that does not exist; systemd cannot exec it"),
    "control-main-sigterm-serving": (
        "none", "not a crash: kill -15 of the serving main process from outside systemd"),
}
CTX_HUGE = os.environ.get("CTX_HUGE", "100000000")  # 2e9 got OOM-killed on the host
LOOP_TIMEOUT_S = 120
SERVE_S = 10


def install(box: Container, name: str, cmd: str, extra: str) -> str:
    unit = f"llamacpp-{name}.service"
    box.write_file(f"/etc/systemd/system/{unit}",
                   UNIT.format(name=name, cmd=cmd.replace("CTX_HUGE", CTX_HUGE), extra=extra))
    box.systemctl("daemon-reload")
    return unit


def healthy(box: Container, unit: str, port: int) -> bool:
    if state(box, unit)["SubState"] != "running":
        return False
    return "HTTP 200" in curl(box, f"http://127.0.0.1:{port}/health", timeout=3)


def loop(box: Container, unit: str, invocations: int, notes: list[str],
         port: int | None = None) -> None:
    """Start; stop once `invocations` runs have ended, or at once if a start serves."""
    loop_until_failed(box, unit, invocations, notes, port=port,
                      timeout=LOOP_TIMEOUT_S * invocations)


def serve_kill(box: Container, unit: str, invocations: int, port: int, notes: list[str],
               sig: int = 9) -> None:
    """Serve, answer one completion, kill -SIG the main process from outside systemd; x N."""
    body = json.dumps({"prompt": "def hello", "n_predict": 8})
    box.systemctl("start", unit, check=False)
    for n in range(invocations):
        wait_for(lambda: healthy(box, unit, port), timeout=120, what="healthy", interval=0.5)
        r = curl(box, f"http://127.0.0.1:{port}/completion", body)
        notes.append(f"inv{n}: completion before kill: {r[-9:]!r}")
        time.sleep(SERVE_S)  # let it serve (idle) a while before the kill
        s = state(box, unit)
        box.run("kill", f"-{sig}", s["MainPID"], check=False)
        notes.append(f"inv{n}: kill -{sig} MainPID {s['MainPID']} at " + time.strftime("%H:%M:%S"))
        wait_for(lambda: state(box, unit)["MainPID"] != s["MainPID"], timeout=60,
                 what="main process to end", interval=0.2)
        if n < invocations - 1:
            wait_for(lambda: state(box, unit)["SubState"] in ("running", "start"), timeout=30,
                     what="restart", interval=0.2)
    wait_for(lambda: state(box, unit)["SubState"] == "auto-restart", timeout=30,
             what="auto-restart", interval=0.1)
    box.systemctl("stop", unit, check=False)


def port_brief(box: Container, unit: str, port: int, notes: list[str]) -> None:
    """A holder unit has the port for the first start only; then the restart should serve."""
    blocker = install(box, "port-holder", f"/usr/bin/python3 -m http.server {port} "
                      "--bind 127.0.0.1", "")
    box.systemctl("start", blocker)
    time.sleep(2)
    box.systemctl("start", unit, check=False)
    wait_for(lambda: failures(box, unit) >= 1, timeout=60, what="first crash", interval=0.1)
    box.systemctl("stop", blocker, check=False)
    notes.append("holder stopped after the first crash at " + time.strftime("%H:%M:%S"))
    wait_for(lambda: healthy(box, unit, port), timeout=120, what="healthy", interval=0.5)
    notes.append("restart served at " + time.strftime("%H:%M:%S"))
    time.sleep(2)
    box.systemctl("stop", unit, check=False)


def clean_stop(box: Container, unit: str, port: int, notes: list[str]) -> None:
    box.systemctl("start", unit, check=False)
    wait_for(lambda: healthy(box, unit, port), timeout=120, what="healthy", interval=0.5)
    body = json.dumps({"prompt": "def hello", "n_predict": 8})
    notes.append("completion: " + curl(box, f"http://127.0.0.1:{port}/completion", body)[-9:])
    box.systemctl("stop", unit, check=False)
    notes.append(f"after stop: {state(box, unit)}")


def jctl(box: Container, *args: str) -> bytes:
    return subprocess.run(["nsenter", "-t", str(box.leader), "-a", "journalctl", "--no-pager",
                           "--all", *args], capture_output=True, check=True, timeout=120).stdout


def save(box: Container, unit: str, out: Path, name: str, notes: list[str]) -> None:
    (out / f"{name}.export").write_bytes(jctl(box, "-u", unit, "-o", "export"))
    (out / "work" / f"{name}.all.short").write_bytes(jctl(box, "-u", unit, "-o", "short-precise"))
    entries = [json.loads(x) for x in jctl(box, "-u", unit, "-o", "json").splitlines() if x]
    ids: list[str] = []
    for e in entries:
        inv = e.get("_SYSTEMD_INVOCATION_ID")
        if inv and inv not in ids:
            ids.append(inv)
    info: dict = {"unit": unit, "invocations": ids, "notes": notes, "lines_per_invocation": []}
    for i, inv in enumerate(ids):
        text = jctl(box, f"_SYSTEMD_INVOCATION_ID={inv}", "-o", "cat")
        if i == 0:
            (out / f"{name}.log").write_bytes(text)
        info["lines_per_invocation"].append(text.count(b"\n"))
    info["pid1"] = [{k: e.get(k) for k in ("__REALTIME_TIMESTAMP", "MESSAGE", "MESSAGE_ID",
                                           "EXIT_CODE", "EXIT_STATUS", "INVOCATION_ID")}
                    for e in entries if e.get("_PID") == "1"]
    first = ids[0] if ids else None
    info["first_inv_times"] = [(e["__REALTIME_TIMESTAMP"], str(e.get("MESSAGE"))[:120])
                               for e in entries if e.get("_SYSTEMD_INVOCATION_ID") == first]
    (out / "work" / f"{name}.info.json").write_text(json.dumps(info, indent=1))
    log(f"{name}: {len(ids)} invocations, lines {info['lines_per_invocation']}; "
        + "; ".join(notes)[:1500])
    for e in info["pid1"]:
        if "exited" in str(e["MESSAGE"]) or "Deactivated" in str(e["MESSAGE"]):
            log(f"   {e['MESSAGE']}")


def main() -> None:
    out = Path(sys.argv[1])
    (out / "work").mkdir(parents=True, exist_ok=True)
    with booted_container([(ROOT, ROOT)], workdir=out / "work") as box:
        log(f"container up, leader {box.leader}")
        for name in sys.argv[2:]:
            cmd, extra, invocations, kind = SCENARIOS[name]
            unit = install(box, name, cmd, extra)
            (out / "work" / f"{name}.unit").write_text(box.systemctl("cat", unit).stdout)
            log(f"{name}: start {unit}: {cmd}")
            notes: list[str] = []
            try:
                what, _, arg = kind.partition(":")
                if what == "loop":
                    loop(box, unit, invocations, notes, port=int(cmd.split("--port ")[1][:5]))
                elif what == "port":
                    blocker = install(box, "port-blocker", "/usr/bin/python3 -m http.server "
                                      f"{arg} --bind 127.0.0.1", "")
                    box.systemctl("start", blocker)
                    time.sleep(2)
                    r = curl(box, f"http://127.0.0.1:{arg}/", timeout=5)
                    notes.append("blocker: " + r[-9:])
                    loop(box, unit, invocations, notes, port=None)
                    box.systemctl("stop", blocker, check=False)
                elif what == "port-brief":
                    port_brief(box, unit, int(arg), notes)
                elif what == "serve-kill":
                    port, _, sig = arg.partition(":")
                    serve_kill(box, unit, invocations, int(port), notes, int(sig or 9))
                elif what == "stop":
                    clean_stop(box, unit, int(arg), notes)
            except Exception as exc:  # keep going: save what happened
                notes.append(f"driver: {type(exc).__name__}: {exc}")
                box.systemctl("stop", unit, check=False)
            save(box, unit, out, name, notes)
    log("container down")


if __name__ == "__main__":
    main()
