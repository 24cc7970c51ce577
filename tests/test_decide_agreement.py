"""The daemon and `triage` decide the same journal the same way: one decide, one evidence record.

The crash is one no signature knows, before the server served, right after a package changed
since the unit's last good start: the environment log in the state database says so (written
as the daemon's drift recorder writes it). The live daemon follows a real journal directory
(the repository's journal writer); `vllm-supervisor triage` then reads the same directory with
the same state database. Both must halt it as inferred fatal, naming the change.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any

from conftest import poll

from vllm_supervisor.app import compose_daemon
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.demo import demo_config
from vllm_supervisor.config import Config, UnitConfig
from vllm_supervisor.environment.drift import DriftRecorder
from vllm_supervisor.environment.log import EnvironmentLog
from vllm_supervisor.environment.snapshot import EnvSnapshot
from vllm_supervisor.journal.writer import (
    JournalWriter,
    exit_entries,
    service_lines,
    start_entries,
)
from vllm_supervisor.store import Store
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

UNIT = "vllm.service"
GOOD, CRASHED = "a" * 32, "b" * 32
UNKNOWN = "RuntimeError: widget 7 fell over"  # no signature knows it, no class says either way
CHANGE = "flashinfer-python 0.6.3 → 0.6.4"


def _snapshot(flashinfer: str) -> EnvSnapshot:
    return EnvSnapshot(
        python="3.11.9",
        packages=MappingProxyType({"torch": "2.5.1", "flashinfer-python": flashinfer}),
        checked=("flashinfer-python", "torch"),
    )


def _environment_recorded(store: Store) -> None:
    """What the drift recorder keeps: each start's snapshot, and the start that served."""
    envlog = EnvironmentLog(store)
    envlog.record_start(UNIT, GOOD, _snapshot("0.6.3"), 1.0)
    envlog.mark_good(UNIT, GOOD)
    envlog.record_start(UNIT, CRASHED, _snapshot("0.6.4"), 2.0)


def _write_journal(writer: JournalWriter) -> None:
    served = ["INFO:     Application startup complete."]
    writer.write([*start_entries(UNIT, GOOD), *service_lines(UNIT, GOOD, served)])
    writer.write(exit_entries(UNIT, GOOD, 0))
    writer.write([*start_entries(UNIT, CRASHED), *service_lines(UNIT, CRASHED, ["INFO loading"])])
    writer.write([*service_lines(UNIT, CRASHED, [UNKNOWN]), *exit_entries(UNIT, CRASHED, 1)])


def _config(root: Path) -> Config:
    return dataclasses.replace(demo_config(root), units=(UnitConfig(name=UNIT),))


def _config_file(root: Path) -> Path:
    path = root / "config.toml"
    path.write_text(
        f"[state]\nstate_dir = {json.dumps(str(root / 'state'))}\n"
        f"runtime_dir = {json.dumps(str(root / 'run'))}\n"
        f"[systemd]\nenabled = false\n[[unit]]\nname = {json.dumps(UNIT)}\n",
        encoding="utf-8",
    )
    return path


async def _daemon_decides(config: Config, writer: JournalWriter) -> dict[str, Any]:
    """The live daemon, as app.py composes it (the drift recorder a hook), on the journal."""
    store = Store.in_directory(config.state.state_dir)
    metrics = Metrics(new_registry(process=False))
    recorder = DriftRecorder(config, EnvironmentLog(store), exec_start=None)
    daemon = compose_daemon(
        config,
        load_table(config),
        store=store,
        metrics=metrics,
        hooks=[recorder],
    )
    stop = asyncio.Event()
    tasks = [asyncio.create_task(daemon.run(stop)), asyncio.create_task(recorder.run(stop))]

    def crashed() -> list[dict[str, Any]]:
        return [h for h in store.history() if h["invocation_id"] == CRASHED]

    try:
        await poll(lambda: crashed() or tasks[0].done(), within=30, each=writer.nudge)
        assert not tasks[0].done(), tasks[0]
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 15)
    (decided,) = crashed()
    store.close()
    return decided


def _triage_decides(journal: Path, config_file: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "vllm_supervisor", "triage", "--format", "json"]
    result = subprocess.run(
        [*command, "--config", str(config_file), str(journal)],
        capture_output=True,
        check=True,
        timeout=60,
    )
    (decided,) = [
        i for i in json.loads(result.stdout)["invocations"] if i["invocation_id"] == CRASHED
    ]
    return decided  # type: ignore[no-any-return]


def _said(item: dict[str, Any]) -> tuple[object, ...]:
    verdict, decision = item["verdict"], item["decision"]
    return (
        decision["action"],
        decision["rule"],
        verdict["severity"],
        verdict["basis"],
        CHANGE in (verdict["severity_reason"] or ""),
        item["drift"],
    )


async def test_a_drift_inferred_crash_is_decided_alike_by_the_daemon_and_triage(
    tmp_path: Path,
) -> None:
    """The same journal and state database: the same decision, the same verdict."""
    config = _config(tmp_path)
    store = Store.in_directory(config.state.state_dir)
    _environment_recorded(store)
    store.close()
    assert config.journal.directory is not None
    with JournalWriter(config.journal.directory) as writer:
        _write_journal(writer)
        daemon = await _daemon_decides(config, writer)
    triage = _triage_decides(config.journal.directory, _config_file(tmp_path))
    expected = ("halt", "inferred_fatal", "fatal", "inferred", True, [CHANGE])
    assert (_said(daemon), _said(triage)) == (expected, expected)
