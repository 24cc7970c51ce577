"""The state database upgrades from what each earlier build left, pending actions included."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from notify_fakes import make_outcome
from test_outbox_sinks import PREVIOUS_SCHEMA

from vllm_supervisor.migrations import VERSION
from vllm_supervisor.records import outcome_record
from vllm_supervisor.store import Store

# The table the build that first carried actions out after their batch made with
# `CREATE TABLE IF NOT EXISTS`, before the schema had versions (its databases say 0).
PENDING_BEFORE_VERSIONS = """
CREATE TABLE pending_action (
    id INTEGER PRIMARY KEY, unit TEXT, key TEXT NOT NULL, outcome TEXT NOT NULL,
    UNIQUE (unit, key)
);
"""


def _database(path: Path, *, pending: bool, version: int) -> None:
    db = sqlite3.connect(path)
    db.executescript(PREVIOUS_SCHEMA)
    if pending:
        db.executescript(PENDING_BEFORE_VERSIONS)
        db.execute(
            "INSERT INTO pending_action (unit, key, outcome) VALUES (?, ?, ?)",
            ("vllm.service", "inv-1", json.dumps(outcome_record(make_outcome()))),
        )
    db.execute(f"PRAGMA user_version = {version}")
    db.commit()
    db.close()


@pytest.mark.parametrize("pending", [False, True], ids=["no-pending-table", "pending-table"])
def test_an_unversioned_database_opens_with_its_pending_actions(
    tmp_path: Path, pending: bool
) -> None:
    path = tmp_path / "state.sqlite3"
    _database(path, pending=pending, version=0)
    store = Store(path)
    assert store.query("PRAGMA user_version") == [(VERSION,)]
    outcomes, unreadable = store.pending_actions()
    assert unreadable == []
    assert [o.invocation.unit for o in outcomes] == (["vllm.service"] if pending else [])


def test_a_version_2_database_gains_the_pending_actions_table(tmp_path: Path) -> None:
    """Version 2 (sinks in the outbox) had no pending actions: the upgrade adds the table."""
    path = tmp_path / "state.sqlite3"
    _database(path, pending=False, version=0)
    Store(path).close()
    db = sqlite3.connect(path)
    db.execute("DROP TABLE pending_action")
    db.execute("PRAGMA user_version = 2")
    db.commit()
    db.close()
    store = Store(path)
    assert store.query("PRAGMA user_version") == [(VERSION,)]
    assert store.pending_actions() == ([], [])
