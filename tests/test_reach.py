"""Drift under the shipped sandbox: which setting hides a served venv, said once per unit."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest
import structlog.testing
from conftest import poll
from hypothesis import given
from hypothesis import strategies as st
from test_drift import UNIT, Journal

from vllm_supervisor.config import Config, UnitConfig
from vllm_supervisor.environment.drift import DriftRecorder
from vllm_supervisor.environment.log import EnvironmentLog
from vllm_supervisor.environment.probe import ProbeError
from vllm_supervisor.environment.reach import environment_root, hidden_by, unreachable
from vllm_supervisor.environment.snapshot import EnvSnapshot
from vllm_supervisor.store import Store


@pytest.mark.parametrize(
    ("path", "setting"),
    [
        ("/home/ops/venv/bin/python", "ProtectHome="),
        ("/root/.venv/bin/python", "ProtectHome="),
        ("/tmp/venv/bin/python", "PrivateTmp="),
        ("/var/tmp/x/bin/python3", "PrivateTmp="),
        ("/opt/venv/bin/python", None),
        ("/homework/bin/python", None),  # a prefix of the name is not the directory
        ("/home/../opt/venv/bin/python", None),
    ],
)
def test_hidden_by(path: str, setting: str | None) -> None:
    """The setting of the shipped unit that hides each place a venv is found."""
    assert hidden_by(path) == setting


def test_the_bound_directory_is_the_venv() -> None:
    """setup binds the venv (bin/'s parent), which the interpreter's site-packages live in."""
    assert environment_root("/home/ops/venv/bin/python") == "/home/ops/venv"


def test_an_unreachable_interpreter_names_the_fix(tmp_path: Path) -> None:
    """A hidden path says which setting and what setup does; a visible one is fine."""
    assert "ProtectHome=" in str(unreachable("/home/nobody-here/venv/bin/python"))
    assert "BindReadOnlyPaths=" in str(unreachable("/home/nobody-here/venv/bin/python"))
    assert unreachable("/bin/sh") is None


@given(st.text())
def test_any_path_is_judged(path: str) -> None:
    """No ExecStart= word or config value crashes the judgement."""
    assert hidden_by(path) in (None, "ProtectHome=", "PrivateTmp=")


def hidden(python: Path, packages: Sequence[str]) -> EnvSnapshot:
    raise ProbeError(f"{python}: cannot run the interpreter: No such file or directory")


async def test_a_hidden_venv_is_said_once_per_unit_not_per_start(tmp_path: Path) -> None:
    """A crash loop of a unit whose venv the sandbox hides: one warning naming the setting,
    not one per start (92 in one run before)."""
    config = Config(units=(UnitConfig(name=UNIT, python="/home/ops/venv/bin/python"),))
    store = Store.in_directory(tmp_path)
    seen: list[str] = []
    recorder = DriftRecorder(
        config,
        EnvironmentLog(store),
        exec_start=None,
        snapshotter=hidden,
        on_snapshot=lambda unit, outcome: seen.append(outcome),
    )
    journal = Journal()
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(recorder.run(stop))
        for serial in range(3):
            recorder.entries([journal.line(f"{serial:032x}", "INFO starting")])
        await poll(lambda: len(seen) == 3, within=10)
        stop.set()
        await asyncio.wait_for(task, 5)
    blind = [e for e in logs if e["event"] == "drift_blind"]
    assert [e["log_level"] for e in blind] == ["warning", "debug", "debug"]
    assert "ProtectHome=" in blind[0]["error"]
    assert seen == ["failed"] * 3
    store.close()
