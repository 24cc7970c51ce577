"""`signatures propose`: a signature from a recorded unknown crash, halting its next start at
its first crash once reloaded (issue 34, 4).

The record is a real daemon's (a `run` child following a journal directory; the crash a real
log, corpus 149's flashinfer kernel failure at the first request, with the flashinfer
signatures left out of the daemon's table, so that it knows the crash as nobody knows a new
one); the proposal goes through `check-config`'s and `signatures test`'s own loaders.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_for
from faults.harness import Supervisor, classified, history_cli, write_config
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.classify.proposal import Refused, generalised_pattern, propose
from vllm_supervisor.classify.signatures import (
    DEFAULT_SIGNATURE_DIR,
    compile_pattern,
    load_signature_table,
)
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.demo import seed_lines
from vllm_supervisor.commands.propose import propose_main
from vllm_supervisor.config import load_config
from vllm_supervisor.errors import SignatureTableError
from vllm_supervisor.journal.saved import decode_export
from vllm_supervisor.journal.writer import (
    FieldValue,
    JournalWriter,
    crashed_invocation,
    export_entry,
)
from vllm_supervisor.model import Action
from vllm_supervisor.pipeline import Pipeline

UNIT = "vllm.service"
CORPUS = Path(__file__).parent / "data" / "corpus"
REAL_LOG = CORPUS / "149-flashinfer-prefill-invalid-resource-handle-first-request-sm121.log"
SERVING = Path(__file__).parent / "data" / "requests" / "serving.txt"
CAUSE = "BatchPrefillWithPagedKVCache failed with error invalid resource handle"


# --- the pattern ----------------------------------------------------------------------------


def test_the_variable_parts_are_generalised() -> None:
    cause = "RuntimeError: widget 7 fell over at /opt/x/y.py reading 'qwen-7b' (id 7ffd12ab9c)"
    pattern = compile_pattern(generalised_pattern(cause))
    assert pattern.search(cause)
    assert pattern.search(
        "RuntimeError: widget 42 fell over at /srv/m/z.py reading 'llama-70b' (id 0badc0ffee1)"
    )
    assert not pattern.search("RuntimeError: gadget 7 fell over at /opt/x/y.py reading 'q'")


@given(st.text(min_size=1, max_size=300).filter(lambda t: t.strip() and "\n" not in t))
def test_any_line_gives_a_pattern_re2_takes_that_matches_it(text: str) -> None:
    pattern = compile_pattern(generalised_pattern(text))
    assert pattern.search(text.strip()) or pattern.search(text)


# --- what a record makes --------------------------------------------------------------------


def _item(**verdict: object) -> dict[str, object]:
    base = {
        "signature": None,
        "root_cause": "RuntimeError: quux widget count fell over in the e2e test",
        "confidence": "high",
        "fingerprint": "2c9ee5206afc9c19",
        "notes": [],
    }
    return {
        "unit": UNIT,
        "invocation_id": "a" * 32,
        "served": False,
        "verdict": {**base, **verdict},
        "decision": {"action": "halt", "rule": "unknown_repeat"},
    }


@pytest.mark.parametrize(
    ("verdict", "words"),
    [
        ({"confidence": "low"}, "its root cause is a guess"),
        ({"notes": ["... the root cause is the last line that looks like one (a guess)"]}, "guess"),
        ({"signature": "nccl_timeout"}, "already known as signature nccl_timeout"),
        ({"root_cause": "ValueError: 12 34 '/x' 0x1f"}, "too little fixed text"),
        ({"root_cause": None}, "no root cause"),
    ],
)
def test_a_record_that_cannot_make_a_good_signature_is_refused(
    verdict: dict[str, object], words: str
) -> None:
    with pytest.raises(Refused, match=words):
        propose(_item(**verdict))


def test_the_proposal_loads_with_the_table_and_names_its_invocation(tmp_path: Path) -> None:
    proposal = propose(_item())
    path = tmp_path / "proposed.toml"
    path.write_text(proposal.toml)
    table = load_signature_table([DEFAULT_SIGNATURE_DIR, path])
    match = table.match("RuntimeError: quux widget count fell over in the e2e test")
    assert match is not None and match.signature.id == proposal.id
    assert f'invocation = "{UNIT} {"a" * 32}"' in proposal.toml
    assert 'severity = "fatal"' in proposal.toml and "serving_severity" not in proposal.toml


def test_an_example_its_pattern_does_not_match_stops_the_load(tmp_path: Path) -> None:
    path = tmp_path / "local.toml"
    path.write_text(
        '[[signature]]\nid = "x"\ntitle = "t"\nseverity = "fatal"\npatterns = ["abc"]\n'
        'examples = ["abd"]\n'
    )
    with pytest.raises(SignatureTableError, match=r"signature 'x': examples\[0\]: not matched"):
        load_signature_table([path])


# --- from a real daemon's record to a first-crash halt ---------------------------------------


def _blind_table(root: Path) -> Path:
    """The shipped table without its flashinfer signatures: the crash is unknown to it."""
    table = root / "table"
    table.mkdir()
    for path in DEFAULT_SIGNATURE_DIR.glob("*.toml"):
        if path.name != "flashinfer.toml":
            shutil.copy(path, table / path.name)
    return table


def _real_crash(serial: int) -> list[dict[str, FieldValue]]:
    """The reporter's crash at the first request after every start: served, then died."""
    lines = [*SERVING.read_text().splitlines(), *REAL_LOG.read_text().splitlines()]
    return crashed_invocation(UNIT, lines, restarts=serial, invocation_id=f"{serial:032x}")


def test_a_recorded_unknown_loop_becomes_a_first_crash_halt(tmp_path: Path) -> None:
    table = _blind_table(tmp_path)
    config_path = write_config(tmp_path, extra=f'[signatures]\npaths = ["{table}"]\n')
    sup = Supervisor(tmp_path, config_path)
    with JournalWriter(tmp_path / "journal") as writer:
        for serial in (1, 2, 3):
            writer.write(_real_crash(serial))
        sup.start()
        wait_for(lambda: len(classified(tmp_path / "state")) == 3, what="three decided")
    assert sup.terminate() == 0, sup.stderr_text()
    recorded = history_cli(tmp_path / "state")
    assert all(i["verdict"]["signature"] is None for i in recorded)
    assert recorded[0]["decision"]["action"] != "halt", recorded[0]  # not at the 1st

    out, err = io.StringIO(), io.StringIO()
    config = load_config(config_path)
    assert propose_main(config, UNIT, write=tmp_path / "signatures.d" / "proposed.toml",
                        out=out, err=err) == 0, err.getvalue()  # fmt: skip
    assert "wrote signature local_internalerror_" in out.getvalue()

    reloaded = load_config(config_path)  # its signatures.d is read beside the table
    pipeline = Pipeline(reloaded, load_table(reloaded))
    data = b"".join(export_entry(e) for e in _real_crash(4))
    ended = pipeline.feed(list(decode_export(data))) + pipeline.finish()
    [outcome] = pipeline.decide_all(ended)
    assert (outcome.verdict.signature or "").startswith("local_internalerror_")
    assert CAUSE in (outcome.verdict.root_cause or "")
    assert outcome.decision.action is Action.HALT, outcome.decision

    # check-config and `signatures test` take the file as the daemon does.
    checked = subprocess.run(
        [sys.executable, "-m", "vllm_supervisor", "check-config", str(config_path)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stderr
    tested = subprocess.run(
        [sys.executable, "-m", "vllm_supervisor", "signatures", "--config", str(config_path),
         "test", str(REAL_LOG)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert tested.returncode == 0 and "local_internalerror_" in tested.stdout, tested.stdout


def test_no_unknown_crash_recorded_is_one_line(tmp_path: Path) -> None:
    config_path = write_config(tmp_path)
    sup = Supervisor(tmp_path, config_path)
    with JournalWriter(tmp_path / "journal") as writer:
        writer.write(crashed_invocation(UNIT, seed_lines(), restarts=1))
        sup.start()
        wait_for(lambda: len(classified(tmp_path / "state")) == 1, what="the halt decided")
    assert sup.terminate() == 0
    err = io.StringIO()
    assert propose_main(load_config(config_path), UNIT, err=err) == 1
    assert err.getvalue().count("\n") == 1
    assert "no recorded crash that no signature knows" in err.getvalue()
