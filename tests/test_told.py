"""The told ledger (supervisor.notify.told): what was told from memory survives a restart.

The restart itself, with a full state disk under a real daemon and a loopback Slack, is
tests/faults/test_faults_disk.py; here the file: any bytes read back, bounds, round trips.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.notify.told import MAX_ENTRIES, ToldLedger, told_path


def test_what_was_saved_is_loaded_and_nothing_leaves_no_file(tmp_path: Path) -> None:
    ledger = ToldLedger(told_path(tmp_path, "slack"))
    ledger.save({("vllm.service", "k1"): 10.0}, {7: 11.0})
    assert ToldLedger(ledger.path).load() == ({("vllm.service", "k1"): 10.0}, {7: 11.0})
    assert ledger.path.stat().st_mode & 0o777 == 0o640
    ledger.save({}, {})
    assert not ledger.path.exists()
    assert ledger.load() == ({}, {})


def test_the_newest_are_kept(tmp_path: Path) -> None:
    ledger = ToldLedger(tmp_path / "told.json")
    ledger.save({("u", str(n)): float(n) for n in range(MAX_ENTRIES + 10)}, {})
    held, _ = ledger.load()
    assert len(held) == MAX_ENTRIES and ("u", "9") not in held and ("u", "10") in held


def test_an_unwritable_place_is_said_once_and_never_raises(tmp_path: Path) -> None:
    (tmp_path / "told").write_text("a file where the directory goes")
    ledger = ToldLedger(told_path(tmp_path, "slack"))
    ledger.save({("u", "k"): 1.0}, {})
    ledger.save({("u", "k"): 1.0}, {})
    assert ledger.load() == ({}, {})


def _read_back(data: bytes) -> tuple[dict[tuple[str, str], float], dict[int, float]]:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "told.json"
        path.write_bytes(data)
        return ToldLedger(path).load()


@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_any_file_reads_as_entries_or_nothing(data: bytes) -> None:
    held, unrecorded = _read_back(data)
    assert all(isinstance(u, str) and isinstance(k, str) for u, k in held)
    assert all(isinstance(i, int) and i >= 0 for i in unrecorded)


JSON_VALUES = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5))
TABLES = st.dictionaries(st.text(max_size=12), JSON_VALUES, max_size=5) | JSON_VALUES


@given(st.dictionaries(st.sampled_from(["held", "unrecorded", "x"]), TABLES))
def test_any_json_object_reads_as_finite_times(raw: dict[str, object]) -> None:
    held, unrecorded = _read_back(json.dumps(raw).encode())
    assert all(math.isfinite(t) for t in [*held.values(), *unrecorded.values()])
