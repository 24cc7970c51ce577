"""`vllm-supervisor demo`: the seed's crash loop in a real journal, and the daemon acting on it.

A vLLM unit crashes three times on the flashinfer-cubin / flashinfer version mismatch, with the
misleading `deepseek_v2.py` traceback and the benign SymmMemCommunicator / FutureWarning noise.
The entries are written with systemd-journal-remote into a real journal file; the daemon then
follows that directory with the real journalctl exactly as it would follow the system journal.
No GPU, no vLLM and no running systemd are needed, so the halt is recorded (quarantine) but no
unit is stopped.
"""

from __future__ import annotations

import asyncio
import io
import shutil
import tempfile
import time
from pathlib import Path

from supervisor.app import load_table, quarantine_dir, run_daemon
from supervisor.config import (
    Config,
    JournalConfig,
    MetricsConfig,
    StateConfig,
    SystemdConfig,
    UnitConfig,
)
from supervisor.gatecmd import gate_main
from supervisor.journal.writer import JournalWriter, crashed_invocation
from supervisor.store import Store
from supervisor.triage import triage

DATA_DIR = Path(__file__).parent / "data"
SEED_LOG = DATA_DIR / "seed-flashinfer-crash.log"
DEMO_UNIT = "vllm.service"
CRASHES = 3
DEADLINE_S = 30.0


def seed_lines() -> list[str]:
    """The seed crash log, one journal line per line."""
    return SEED_LOG.read_text(encoding="utf-8").splitlines()


def write_demo_journal(directory: Path, *, crashes: int = CRASHES) -> int:
    """Write the crash loop into a journal in `directory`; return the number of entries."""
    entries = []
    for restart in range(crashes):
        entries += crashed_invocation(
            DEMO_UNIT, seed_lines(), restarts=restart + 1, pid=7000 + restart
        )
    with JournalWriter(directory) as writer:
        writer.write(entries)
    return len(entries)


def demo_config(root: Path) -> Config:
    """The daemon's config for the demo: the demo journal, private state, no systemd calls."""
    return Config(
        units=(UnitConfig(name=DEMO_UNIT),),
        journal=JournalConfig(directory=root / "journal", start_at="head"),
        state=StateConfig(state_dir=root / "state", runtime_dir=root / "run"),
        metrics=MetricsConfig(listen="127.0.0.1:0"),
        systemd=SystemdConfig(enabled=False),
    )


def run_demo(*, directory: Path | None = None, keep: bool = False) -> int:
    """Write the journal, triage it, run the daemon on it, show what it decided."""
    root = directory or Path(tempfile.mkdtemp(prefix="vllm-supervisor-demo-"))
    try:
        count = write_demo_journal(root / "journal")
        config = demo_config(root)
        print(
            f"== wrote {count} journal entries ({CRASHES} crashes of {DEMO_UNIT}) "
            f"to {root / 'journal'} with systemd-journal-remote\n"
        )
        print("== vllm-supervisor triage (what a person would have grepped for)\n")
        buffer = io.StringIO()
        triage(str(root / "journal"), config=config, table=load_table(config), out=buffer)
        print(buffer.getvalue())
        print("== vllm-supervisor run --directory (the daemon following that journal)\n")
        asyncio.run(_run_until_handled(config, expected=CRASHES))
        _show_results(config)
    finally:
        if not keep and directory is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


async def _run_until_handled(config: Config, *, expected: int) -> None:
    stop, reload = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run_daemon(config, stop, reload))
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and not task.done():
        if len(_history(config)) >= expected:
            break
        await asyncio.sleep(0.05)  # polling a condition with a deadline, not synchronisation
    stop.set()
    await task


def _history(config: Config) -> list[dict[str, object]]:
    path = config.state.state_dir
    if not path.exists():
        return []
    store = Store.in_directory(path)
    try:
        return store.history()
    finally:
        store.close()


def _show_results(config: Config) -> None:
    for item in _history(config):
        verdict, decision = item["verdict"], item["decision"]
        assert isinstance(verdict, dict) and isinstance(decision, dict)  # noqa: S101
        print(
            f"  {item['unit']} {item['invocation_id']}: {verdict['severity']} "
            f"{verdict['signature']} -> {decision['action']}"
        )
        print(f"    root cause:  {verdict['root_cause']}")
        print(f"    remediation: {verdict['remediation']}")
    print(f"\n== quarantine records in {quarantine_dir(config)}:")
    for path in sorted(quarantine_dir(config).glob("*")):
        print(f"  {path.name}")
    print(f"\n== vllm-supervisor gate {DEMO_UNIT} (the served unit's ExecCondition=):")
    status = gate_main(DEMO_UNIT, config.state.runtime_dir, config.state.state_dir)
    print(f"  exit status {status}: systemd would {'skip' if status else 'allow'} the next start")
