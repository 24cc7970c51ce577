"""`vllm-supervisor demo`: the seed's crash loop, a hung engine and environment drift, for real.

The story, written with systemd-journal-remote into a real journal that the daemon follows with
the real journalctl, exactly as it would follow the system journal:

1. `vllm.service` starts in a real virtual environment (flashinfer-python, -cubin and
   -jit-cache all 0.6.3) and serves: a good start, whose environment the daemon records.
2. A reinstall upgrades flashinfer-python to 0.6.4 and leaves flashinfer-cubin at 0.6.3. The unit
   crashes three times on the seed's traceback (the misleading `deepseek_v2.py` crash site, the
   benign SymmMemCommunicator / FutureWarning noise): the daemon halts it after the first crash
   and names what changed since the good start.
3. `vllm-chat.service` logs EngineDeadError while its API server keeps answering 500 on its
   loopback health URL: after the grace period the daemon closes it as hung.

A loopback HTTP endpoint stands in for both the health URL and the Slack webhook, so the
messages Slack would get are printed. Then `preflight` checks the upgraded environment and
`triage` reads the journal the way a person would. No GPU, no vLLM and no running systemd are
needed: the halt is recorded (quarantine) but no unit is stopped or restarted.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from ..actions import quarantine_dir
from ..app import run_daemon
from ..classify import load_table
from ..config import (
    Config,
    JournalConfig,
    MetricsConfig,
    Secret,
    SlackConfig,
    StateConfig,
    SystemdConfig,
    UnitConfig,
)
from ..environment import EnvironmentLog
from ..errors import ConfigError, StateError, SupervisorError
from ..journal import FieldValue, JournalWriter, crashed_invocation, lifecycle, service_lines
from ..model import LifecycleEvent
from ..store import Store
from ..story import NO_ROOT_CAUSE, shown, told
from ..telemetry.logs import configure_logging
from .gate import gate_main
from .preflight import preflight_main
from .triage import triage

DATA_DIR = Path(__file__).parent.parent / "data"
SEED_LOG = DATA_DIR / "seed-flashinfer-crash.log"
DEMO_UNIT = "vllm.service"
HUNG_UNIT = "vllm-chat.service"
CRASHES = 3
HANG_GRACE_S = 2.0
DEADLINE_S = 30.0
_T = TypeVar("_T")

Dist = tuple[str, str, Sequence[str]]  # name, version, Requires-Dist lines
GOOD_ENVIRONMENT: tuple[Dist, ...] = (
    ("flashinfer-python", "0.6.3", ()),
    ("flashinfer-cubin", "0.6.3", ()),
    ("flashinfer-jit-cache", "0.6.3", ()),
    ("vllm", "0.11.1", ()),
    ("torch", "2.9.0", ()),
)
SERVING = [
    "(APIServer pid=7000) INFO 03-03 08:10:02 [api_server.py:1885] vLLM API server version 0.11.1",
    "(APIServer pid=7000) INFO:     Started server process [7000]",
    "(APIServer pid=7000) INFO:     Application startup complete.",
]
HUNG = [
    *SERVING,
    "(Worker_TP1 pid=7301) [rank1]:[E303 10:11:03.123456 7301 ProcessGroupNCCL.cpp:632] [Rank 1]"
    " Watchdog caught collective operation timeout: WorkNCCL(SeqNum=52311, OpType=ALLREDUCE,"
    " NumelIn=4194304, NumelOut=4194304, Timeout(ms)=600000) ran for 600081 milliseconds before"
    " timing out.",
    "(APIServer pid=7000) ERROR 03-03 10:11:04 [async_llm.py:480] AsyncLLM output_handler failed.",
    "(APIServer pid=7000) ERROR 03-03 10:11:04 [async_llm.py:480] Traceback (most recent call"
    " last):",
    '(APIServer pid=7000) ERROR 03-03 10:11:04 [async_llm.py:480]   File "/opt/venv/lib/python3.12/'
    'site-packages/vllm/v1/engine/async_llm.py", line 439, in output_handler',
    "(APIServer pid=7000) ERROR 03-03 10:11:04 [async_llm.py:480]     outputs = await"
    " engine_core.get_output_async()",
    "(APIServer pid=7000) ERROR 03-03 10:11:04 [async_llm.py:480] vllm.v1.engine.exceptions."
    "EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the root cause.",
    '(APIServer pid=7000) INFO:     127.0.0.1:40000 - "POST /v1/completions HTTP/1.1" 500',
]


def seed_lines() -> list[str]:
    """The seed crash log, one journal line per line."""
    return SEED_LOG.read_text(encoding="utf-8").splitlines()


def write_demo_journal(directory: Path, *, crashes: int = CRASHES) -> int:
    """Write the seed crash loop into a journal in `directory`; return the number of entries."""
    entries = _crash_loop(crashes)
    with JournalWriter(directory) as writer:
        writer.write(entries)
    return len(entries)


def _crash_loop(crashes: int) -> list[dict[str, FieldValue]]:
    entries = []
    for restart in range(crashes):
        entries += crashed_invocation(
            DEMO_UNIT, seed_lines(), restarts=restart + 1, pid=7000 + restart
        )
    return entries


def demo_config(root: Path) -> Config:
    """The daemon's config for the demo: the demo journal, private state, no systemd calls."""
    return Config(
        units=(UnitConfig(name=DEMO_UNIT),),
        journal=JournalConfig(directory=root / "journal", start_at="head"),
        state=StateConfig(state_dir=root / "state", runtime_dir=root / "run"),
        metrics=MetricsConfig(listen="127.0.0.1:0"),
        systemd=SystemdConfig(enabled=False),
    )


def write_dist(site: Path, name: str, version: str, requires: Sequence[str] = ()) -> None:
    """Write the dist-info directory pip would leave for `name` `version` (all that
    `importlib.metadata` reads: METADATA, INSTALLER, RECORD)."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (info / "INSTALLER").write_text("pip\n", encoding="utf-8")
    record = [f"{info.name}/{f},," for f in ("METADATA", "INSTALLER", "RECORD")]
    (info / "RECORD").write_text("\n".join(record) + "\n", encoding="utf-8")


def site_packages(venv: Path) -> Path:
    """The venv's site-packages directory (made by this interpreter's version)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return venv / "lib" / version / "site-packages"


def make_venv(venv: Path, dists: Sequence[Dist]) -> Path:
    """A real venv (no pip) holding `dists`; return its interpreter."""
    made = subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        last = (made.stderr.strip().splitlines() or ["no message"])[-1]
        raise SupervisorError(f"demo: cannot make the virtual environment {venv}: {last}")
    for name, version, requires in dists:
        write_dist(site_packages(venv), name, version, requires)
    return venv / "bin" / "python"


class DemoEndpoint:
    """Loopback HTTP: `/health` answers 500 (a dead engine), POSTs are Slack messages kept."""

    def __init__(self) -> None:
        self.messages: list[dict[str, object]] = []
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = await reader.readexactly(length) if length else b""
            if head.startswith(b"POST"):
                self.messages.append(json.loads(body))
                status, text = b"200 OK", b"ok"
            else:
                status, text = b"500 Internal Server Error", b"EngineDeadError"
            writer.write(
                b"HTTP/1.1 " + status + b"\r\nContent-Length: "
                + str(len(text)).encode() + b"\r\nConnection: close\r\n\r\n" + text
            )  # fmt: skip
            await writer.drain()
        except (asyncio.IncompleteReadError, ValueError, ConnectionError):
            pass  # a demo endpoint: a bad request just ends the connection
        finally:
            writer.close()

    def webhook_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/services/T0DEMO/B0DEMO/demo-secret"

    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/health"


def full_demo_config(root: Path, *, python: Path, endpoint: DemoEndpoint) -> Config:
    """Two units: the crash-looping one in a real venv, and one with a health URL that fails."""
    return dataclasses.replace(
        demo_config(root),
        units=(
            UnitConfig(name=DEMO_UNIT, python=str(python)),
            UnitConfig(name=HUNG_UNIT, health_url=endpoint.health_url(), hang_grace_s=HANG_GRACE_S),
        ),
        slack=SlackConfig(webhook_url=Secret(endpoint.webhook_url()), min_interval_s=0.01),
    )


def run_demo(*, directory: Path | None = None, keep: bool = False) -> int:
    """Play the story into a real journal, with the daemon following it; show what it did."""
    root = _demo_root(directory)
    try:
        config, endpoint, python = asyncio.run(_demo(root))
        _show_results(config, endpoint, python)
        return 0
    finally:
        if not keep and directory is None:
            shutil.rmtree(root, ignore_errors=True)


def _demo_root(directory: Path | None) -> Path:
    """`--directory` made ready (ConfigError when it cannot be), or a fresh temp directory."""
    if directory is None:
        return Path(tempfile.mkdtemp(prefix="vllm-supervisor-demo-"))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()  # writable, not only existing
    except OSError as exc:
        raise ConfigError(
            f"demo --directory {directory}: cannot write there: {exc.strerror or exc}"
        ) from exc
    return directory


async def _demo(root: Path) -> tuple[Config, DemoEndpoint, Path]:
    python = make_venv(root / "venv", GOOD_ENVIRONMENT)
    endpoint = DemoEndpoint()
    await endpoint.start()
    config = full_demo_config(root, python=python, endpoint=endpoint)
    stop, reload = asyncio.Event(), asyncio.Event()
    try:
        with JournalWriter(root / "journal") as writer:
            good = "a" * 32
            print(f"== 1. {DEMO_UNIT} starts in {root / 'venv'} and serves (a good start)\n")
            writer.write(_good_start(good))
            daemon = asyncio.create_task(run_daemon(config, stop, reload))
            await _until(lambda: _recorded(config, good), writer, daemon, "the good start")
            writer.write([_stopped(good)])

            print(
                "\n== 2. a reinstall upgrades flashinfer-python 0.6.3 -> 0.6.4 and leaves "
                f"flashinfer-cubin at 0.6.3; {DEMO_UNIT} crash-loops\n"
            )
            _upgrade(root / "venv")
            writer.write(_crash_loop(CRASHES))
            await _until(lambda: _crashes(config, DEMO_UNIT) >= CRASHES, writer, daemon, "halt")

            print(f"\n== 3. {HUNG_UNIT}: the engine dies, the API server stays up answering 500\n")
            writer.write(_hung_invocation("c" * 32))
            await _until(lambda: _crashes(config, HUNG_UNIT) >= 1, writer, daemon, "the hang")
            await _until(lambda: len(endpoint.messages) >= 2, writer, daemon, "the Slack messages")
    finally:
        stop.set()
        if "daemon" in locals():
            await daemon
        await endpoint.close()
    return config, endpoint, python


async def _until(
    done: Callable[[], bool], writer: JournalWriter, daemon: asyncio.Task[None], what: str
) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        if daemon.done():
            daemon.result()  # the daemon's own error, if it died
            raise SupervisorError(f"demo: the daemon stopped before {what}")
        if time.monotonic() > deadline:
            raise SupervisorError(f"demo: no {what} within {DEADLINE_S:.0f} s")
        writer.nudge()  # wakes journalctl --follow on a journal-remote file
        await asyncio.sleep(0.05)  # polling a condition with a deadline, not synchronisation


def _good_start(inv: str) -> list[dict[str, FieldValue]]:
    started = lifecycle(DEMO_UNIT, inv, LifecycleEvent.JOB_STARTED, f"Started {DEMO_UNIT}.")
    return [started, *service_lines(DEMO_UNIT, inv, SERVING, pid=6900)]


def _stopped(inv: str) -> dict[str, FieldValue]:
    return lifecycle(DEMO_UNIT, inv, LifecycleEvent.DEACTIVATED, "Deactivated successfully.")


def _hung_invocation(inv: str) -> list[dict[str, FieldValue]]:
    started = lifecycle(HUNG_UNIT, inv, LifecycleEvent.JOB_STARTED, f"Started {HUNG_UNIT}.")
    return [started, *service_lines(HUNG_UNIT, inv, HUNG, pid=7000)]


def _upgrade(venv: Path) -> None:
    site = site_packages(venv)
    shutil.rmtree(site / "flashinfer_python-0.6.3.dist-info")
    write_dist(site, "flashinfer-python", "0.6.4")


def _recorded(config: Config, invocation_id: str) -> bool:
    found = _with_store(
        config, lambda s: EnvironmentLog(s).for_invocation(DEMO_UNIT, invocation_id)
    )
    return found is not None


def _crashes(config: Config, unit: str) -> int:
    """Invocations of `unit` the daemon acted on (a clean stop is history, not a crash)."""
    return sum(1 for item in _history(config, unit) if _action(item) != "observe")


def _action(item: dict[str, object]) -> str:
    decision = item["decision"]
    return str(decision["action"]) if isinstance(decision, dict) else ""


def _history(config: Config, unit: str | None = None) -> list[dict[str, object]]:
    return _with_store(config, lambda s: s.history(unit)) or []


def _with_store(config: Config, read: Callable[[Store], _T]) -> _T | None:
    store = Store.existing_in_directory(config.state.state_dir)
    if store is None:
        return None
    try:
        return read(store)
    except StateError:  # read-only: the daemon may not have made its tables yet
        return None
    finally:
        store.close()


def _show_results(config: Config, endpoint: DemoEndpoint, python: Path) -> None:
    print("\n== vllm-supervisor history (what the daemon decided)\n")
    for item in _history(config):
        verdict, decision = item["verdict"], item["decision"]
        assert isinstance(verdict, dict) and isinstance(decision, dict)  # noqa: S101
        if decision["action"] == "observe":
            continue
        hung = "  (engine hung)" if item.get("hung") else ""
        print(
            f"  {item['unit']} {item['invocation_id']}: {verdict['severity']} "
            f"{shown(verdict['signature'])}{hung}"
        )
        print(f"    {told(str(decision['action']), str(item['taken']))}")
        if item.get("already_halted_by"):
            print(f"    the same loop: already halted by {item['already_halted_by']}")
            continue
        print(f"    root cause:  {verdict['root_cause'] or NO_ROOT_CAUSE}")
        print(f"    remediation: {shown(verdict['remediation'])}")
        drift = item.get("drift")
        if isinstance(drift, list) and drift:
            print(f"    changed since the last good start: {'; '.join(drift)}")
    print(f"\n== Slack: {len(endpoint.messages)} messages to the (loopback) webhook\n")
    for message in endpoint.messages:
        print("  " + str(message.get("text", "")).replace("\n", "\n  ") + "\n")
    print(f"== quarantine records in {quarantine_dir(config)}:")
    for path in sorted(quarantine_dir(config).glob("*")):
        print(f"  {path.name}")
    print(f"\n== vllm-supervisor gate {DEMO_UNIT} (the served unit's ExecCondition=):")
    status = gate_main(
        DEMO_UNIT, config.state.runtime_dir, config.state.state_dir, wait_s=config.gate.wait_s
    )
    print(f"  exit status {status}: systemd would {'skip' if status else 'allow'} the next start")
    print(f"\n== vllm-supervisor preflight {DEMO_UNIT} --python {python} (before a start)\n")
    status = preflight_main(
        DEMO_UNIT,
        python=python,
        port=None,
        runtime_dir=config.state.runtime_dir,
        state_dir=config.state.state_dir,
        output_format="text",
        exec_start=lambda unit: None,
    )
    print(f"  exit status {status}: the start would fail here, before any weights load")
    print("\n== vllm-supervisor triage (what a person would have grepped for)\n")
    buffer = io.StringIO()
    triage(str(config.journal.directory), config=config, table=load_table(config), out=buffer)
    print(buffer.getvalue())


def main(args: argparse.Namespace) -> int:
    """`demo`: write the seed crash loop into a real journal and run the daemon on it."""
    # The demo prints its own sections; between them only the daemon's warnings (a halt, a
    # hung engine), as readable lines, not JSON.
    configure_logging(level=os.environ.get("VLLM_SUPERVISOR_LOG_LEVEL", "warning"), json=False)
    return run_demo(directory=args.directory, keep=args.keep)
