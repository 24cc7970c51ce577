"""One story per event: history, triage, Slack and preflight use one vocabulary, never print
`None`, and say plainly when there is nothing to read."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from fakevenv import Venvs, session_venvs
from faults.harness import UNIT, crash, write_config
from hypothesis import given
from hypothesis import strategies as st
from notify_fakes import make_outcome

from vllm_supervisor.actions.preflight import run_preflight
from vllm_supervisor.actions.quarantine import Quarantine
from vllm_supervisor.commands.history import _history_text
from vllm_supervisor.commands.triage import render_text
from vllm_supervisor.journal.writer import JournalWriter
from vllm_supervisor.model import Action, Outcome, Severity, Taken
from vllm_supervisor.notify.message import build_payload
from vllm_supervisor.store import Checkpoint, Store
from vllm_supervisor.story import told


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """The installed command, run as a person would."""
    return subprocess.run(
        [sys.executable, "-m", "vllm_supervisor", *map(str, args)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_triage_of_an_empty_input_says_so_and_exits_2(tmp_path: Path) -> None:
    """No invented "No crash found" invocation: one line, exit 2."""
    empty = tmp_path / "empty.log"
    empty.write_text("", encoding="utf-8")
    done = cli("triage", empty)
    assert done.returncode == 2, done
    assert done.stderr == f"vllm-supervisor: triage: {empty}: no journal entries\n", done.stderr
    assert "No crash found" not in done.stdout + done.stderr


def test_triage_says_the_shared_words_and_no_none(tmp_path: Path) -> None:
    """A crash read from a real journal file is said in the shared words; a saved plain-text
    log (no restart counter, no exit) says `unknown` where a fact is missing."""
    with JournalWriter(tmp_path / "journal") as writer:
        writer.write(crash("fatal", 1))
    done = cli("triage", tmp_path / "journal", "--unit", UNIT)
    assert done.returncode == 0, done.stderr
    assert "None" not in done.stdout
    assert told("halt", None) in done.stdout
    text = tmp_path / "server.log"
    text.write_text("RuntimeError: CUDA error: out of memory\n", encoding="utf-8")
    done = cli("triage", text)
    assert done.returncode == 0, done.stderr
    assert "None" not in done.stdout
    assert "restarts=unknown" in done.stdout


def test_history_says_the_same_words_and_no_none(tmp_path: Path) -> None:
    """A recorded crash without a root-cause line, decided allow-restart and left down: history
    prints the shared story (`allow-restart → down`) and no `None`."""
    config = write_config(tmp_path)
    outcome = make_outcome(action=Action.ALLOW_RESTART, taken=Taken.DOWN)
    outcome = dataclasses.replace(
        outcome, verdict=dataclasses.replace(outcome.verdict, root_cause=None)
    )
    store = Store.in_directory(tmp_path / "state")
    store.commit_batch(checkpoint=Checkpoint(cursor="c"), outcomes=[outcome])
    store.close()
    done = cli("history", "--config", config)
    assert done.returncode == 0, done.stderr
    assert "None" not in done.stdout
    assert told("allow-restart", "down") in done.stdout
    payload = json.dumps(build_payload(outcome, host="h"), ensure_ascii=False)
    assert told("allow-restart", "down") in payload


@pytest.fixture(scope="module", name="venvs")
def _venvs(tmp_path_factory: pytest.TempPathFactory) -> Venvs:
    return session_venvs(tmp_path_factory)


def test_preflight_says_each_failure_once_and_names_the_unit(tmp_path: Path, venvs: Venvs) -> None:
    """The package check and the quarantine find the same crash: one FAIL line for it, and
    the release command names the unit, never a placeholder."""
    Quarantine(tmp_path).write(
        UNIT,
        {"signature": "flashinfer_cubin_mismatch", "title": "t", "remediation": "Pin it."},
    )
    report = run_preflight(
        python=venvs["upgraded"], port=None, quarantine_dir=tmp_path, unit=UNIT, table=None
    )
    text = report.render_text()
    assert text.count("FAIL flashinfer_cubin_mismatch") == 1, text
    assert "release UNIT" not in text
    assert f"vllm-supervisor release {UNIT}" in text
    assert "preflight vllm.service: 1 failed" in text


_TEXT = st.text(st.characters(blacklist_characters="N", codec="utf-8"), max_size=40)


@st.composite
def outcomes(draw: st.DrawFn) -> Outcome:
    """Crashes with any of their optional facts missing."""
    outcome = make_outcome(
        unit=draw(st.none() | st.just(UNIT)),
        invocation_id=draw(st.none() | st.just("inv-9")),
        signature=draw(st.none() | st.just("nccl_timeout")),
        severity=draw(st.sampled_from(Severity)),
        action=draw(st.sampled_from(Action)),
        restarts=draw(st.none() | st.integers(0, 9)),
        root_cause=draw(_TEXT),
        crash_site=draw(st.none() | _TEXT),
        remediation=draw(st.none() | _TEXT),
        taken=draw(st.sampled_from(Taken)),
    )
    inv = dataclasses.replace(
        outcome.invocation,
        exit_code=draw(st.none() | st.just("exited")),
        exit_status=draw(st.none() | st.integers(0, 255)),
        result=draw(st.none() | st.just("exit-code")),
    )
    verdict = dataclasses.replace(outcome.verdict, root_cause=draw(st.none() | _TEXT))
    return dataclasses.replace(outcome, invocation=inv, verdict=verdict)


@given(outcome=outcomes())
def test_no_outcome_renders_none(outcome: Outcome) -> None:
    """Whatever is missing, no renderer for a person prints `None`."""
    item = {**outcome.to_json(), "time": "2026-01-01T00:00:00+00:00", "notified": False}
    assert "None" not in render_text([outcome])
    assert "None" not in _history_text(item)
    assert "None" not in json.dumps(build_payload(outcome, host="h"))
