"""A halt lasts until what caused it changes, no longer.

Seen on systemd 252: an unrelated local user listened on the unit's port during a restart and
went away; `port_held` quarantined the unit and every start after was refused until a person
ran `release`. A model on a network mount not there yet at boot (`FileNotFoundError`) that
appeared 20 s later: halted at the 1st crash, and still halted after the path existed.
"""

from __future__ import annotations

import io
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from corpus_judge import failed_invocation
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.actions.evidence import changed, evidence_of
from vllm_supervisor.actions.halt import quarantine_record
from vllm_supervisor.actions.quarantine import Quarantine
from vllm_supervisor.classify.classifier import Classifier
from vllm_supervisor.classify.signatures import load_signature_table
from vllm_supervisor.commands.gate import EXIT_ALLOW, EXIT_QUARANTINED, gate_main
from vllm_supervisor.model import Action, Decision, Outcome, Rule

UNIT = "vllm.service"


def outcome(root_cause_lines: list[str], rule: Rule) -> Outcome:
    invocation = failed_invocation(root_cause_lines)
    verdict = Classifier(load_signature_table()).classify(invocation.lines)
    return Outcome(
        invocation=invocation,
        verdict=verdict,
        decision=Decision(action=Action.HALT, reason="test", rule=rule),
    )


@pytest.fixture(name="listening")
def _listening() -> Iterator[socket.socket]:
    """A socket another process would hold: listening on a free loopback port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def gate(tmp_path: Path) -> tuple[int, str]:
    out = io.StringIO()
    code = gate_main(UNIT, tmp_path / "run", tmp_path / "state", wait_s=1.0, out=out, defaults=())
    return code, out.getvalue()


def quarantine(tmp_path: Path, record: dict[str, Any]) -> Quarantine:
    records = Quarantine(tmp_path / "run" / "quarantine")
    records.write(UNIT, record)
    return records


class TestPortHeld:
    def test_the_record_keeps_the_port(self, listening: socket.socket) -> None:
        port = listening.getsockname()[1]
        lines = [
            "OSError: [Errno 98] error while attempting to bind on address "
            f"('0.0.0.0', {port}): address already in use"
        ]
        record = quarantine_record(outcome(lines, Rule.PORT_HELD))
        assert record["evidence"] == {"kind": "port_held", "port": port}

    def test_refused_while_held_then_let_through_once_free(
        self, tmp_path: Path, listening: socket.socket
    ) -> None:
        port = listening.getsockname()[1]
        records = quarantine(tmp_path, {"evidence": {"kind": "port_held", "port": port}})
        assert gate(tmp_path)[0] == EXIT_QUARANTINED
        assert records.is_quarantined(UNIT)
        listening.close()
        code, text = gate(tmp_path)
        assert code == EXIT_ALLOW
        assert f"port {port} is free now" in text and "halt is lifted" in text
        assert not records.is_quarantined(UNIT)


class TestMissingPath:
    def test_the_record_keeps_the_missing_path(self, tmp_path: Path) -> None:
        missing = tmp_path / "mnt" / "models" / "llama" / "config.json"
        lines = [
            "Traceback (most recent call last):",
            '  File "/opt/venv/lib/python3.12/site-packages/vllm/config.py", line 1, in load',
            "    open(path)",
            f"FileNotFoundError: [Errno 2] No such file or directory: '{missing}'",
        ]
        record = quarantine_record(outcome(lines, Rule.INFERRED_FATAL))
        assert record["evidence"] == {"kind": "missing_path", "path": str(missing)}

    def test_refused_while_missing_then_let_through_once_it_exists(self, tmp_path: Path) -> None:
        missing = tmp_path / "mnt" / "models"
        records = quarantine(tmp_path, {"evidence": {"kind": "missing_path", "path": str(missing)}})
        assert gate(tmp_path)[0] == EXIT_QUARANTINED
        missing.mkdir(parents=True)  # the network mount arrives
        code, text = gate(tmp_path)
        assert code == EXIT_ALLOW and f"{missing} exists now" in text
        assert not records.is_quarantined(UNIT)


def test_a_halt_with_nothing_that_can_change_stays(tmp_path: Path) -> None:
    """The flashinfer mismatch: no evidence the gate can re-check, so only `release` lifts it."""
    lines = ["RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version "
             "(0.6.4)"]  # fmt: skip
    record = quarantine_record(outcome(lines, Rule.FATAL_SIGNATURE))
    assert record["evidence"] is None
    quarantine(tmp_path, record)
    assert gate(tmp_path)[0] == EXIT_QUARANTINED


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


@given(
    st.dictionaries(
        st.sampled_from(["evidence", "kind", "port", "path"]),
        JSON | st.fixed_dictionaries({"kind": st.sampled_from(["port_held", "missing_path"])}),
    )
)
def test_no_record_crashes_the_check(record: dict[str, Any]) -> None:
    """A record is read back from disk: whatever it holds, the check answers, never raises."""
    result = changed(record)
    assert result is None or isinstance(result, str)


def test_no_outcome_without_evidence_gets_some() -> None:
    assert evidence_of(outcome(["ValueError: bad"], Rule.INFERRED_FATAL)) is None
