"""The state database upgrades from what each earlier build left, pending actions and the
environment log included."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from notify_fakes import make_outcome
from test_outbox_sinks import PREVIOUS_SCHEMA

from vllm_supervisor.environment.log import EnvironmentLog
from vllm_supervisor.environment.snapshot import EnvSnapshot
from vllm_supervisor.migrations import STEPS, VERSION
from vllm_supervisor.notify.level import IncidentTable
from vllm_supervisor.notify.queue import OutboxQueue
from vllm_supervisor.records import outcome_record
from vllm_supervisor.store import Checkpoint, Store

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


# What the environment log made for itself (supervisor.environment.log) before the schema's step 4
# took its table over: a database of schema 3 that the daemon ran on has it, with its rows.
ENVIRONMENT_LOG_BEFORE_STEP_4 = """
CREATE TABLE IF NOT EXISTS environment_log (
    unit TEXT NOT NULL, invocation_id TEXT NOT NULL, started REAL NOT NULL,
    snapshot TEXT NOT NULL, good INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (unit, invocation_id)
);
CREATE INDEX IF NOT EXISTS environment_log_unit_started ON environment_log (unit, started);
"""


def _version_3_database(path: Path, *, environment_log: bool) -> None:
    """A database as the release before step 4 left it, a row in every table."""
    db = sqlite3.connect(path)
    for step in STEPS[:3]:
        db.executescript(step)
    if environment_log:
        db.executescript(ENVIRONMENT_LOG_BEFORE_STEP_4)
        for invocation_id, torch, good in (("inv-0", "2.9.0", 1), ("inv-1", "2.10.0", 0)):
            snapshot = EnvSnapshot(python="3.11.7", packages={"torch": torch}, checked=("torch",))
            db.execute(
                "INSERT INTO environment_log VALUES ('vllm.service', ?, ?, ?, ?)",
                (invocation_id, float(len(torch)), json.dumps(snapshot.to_json()), good),
            )
    outcome = make_outcome(invocation_id="inv-1")
    db.execute("INSERT INTO meta VALUES ('cursor', 'c9'), ('replay', 'c7')")
    db.execute("""INSERT INTO unit_state VALUES ('vllm.service', '{"streak": 2}')""")
    db.execute(
        "INSERT INTO history (unit, invocation_id, time, outcome, notified)"
        " VALUES ('vllm.service', 'inv-1', 1.0, ?, 1)",
        (json.dumps(outcome.to_json()),),
    )
    db.execute(
        "INSERT INTO pending_action (unit, key, outcome) VALUES ('vllm.service', 'inv-2', ?)",
        (json.dumps(outcome_record(make_outcome(invocation_id="inv-2"))),),
    )
    db.execute(
        "INSERT INTO outbox (id, sink, created, due, payload) VALUES (1, 'slack', 1, 1, '{}')"
    )
    db.execute(
        "INSERT INTO outbox_member (sink, message_id, unit, invocation_id, dedupe_key, time)"
        " VALUES ('slack', 1, 'vllm.service', 'inv-1', 'inv-1', 1.0)"
    )
    db.execute(
        """INSERT INTO incident VALUES ('alertmanager', 'vllm.service', '{"alertname": "x"}')"""
    )
    db.execute("PRAGMA user_version = 3")
    db.commit()
    db.close()


def test_a_version_3_database_opens_and_reads_back_every_table(tmp_path: Path) -> None:
    """The release before step 4: every row is read back through its repository, the
    environment log's included."""
    path = tmp_path / "state.sqlite3"
    _version_3_database(path, environment_log=True)
    store = Store(path)
    try:
        assert store.query("PRAGMA user_version") == [(VERSION,)]
        assert store.load_checkpoint() == Checkpoint(cursor="c9", replay_from="c7")
        assert store.load_unit_states() == {"vllm.service": {"streak": 2}}
        ((item),) = store.history()
        assert (item["invocation_id"], item["notified"]) == ("inv-1", True)
        pending, unreadable = store.pending_actions()
        assert [o.invocation.invocation_id for o in pending] == ["inv-2"] and unreadable == []
        queue = OutboxQueue(store, "slack")
        assert queue.depth() == 1
        assert queue.of_member(("vllm.service", "inv-1")) is not None
        incidents = store.read(lambda db: IncidentTable(db, "alertmanager").sent())
        assert incidents == {"vllm.service": {"alertname": "x"}}
        envlog = EnvironmentLog(store)
        good = envlog.last_good("vllm.service")
        assert good is not None and good.packages["torch"] == "2.9.0"
        changes = envlog.changes_since_last_good("vllm.service", "inv-1")
        assert [str(c) for c in changes] == ["torch 2.9.0 → 2.10.0"]
    finally:
        store.close()


def test_a_version_3_database_without_an_environment_log_gains_one(tmp_path: Path) -> None:
    """A database no daemon ran on (only a command made it) had no environment log: step 4
    makes it, and the log records into it."""
    path = tmp_path / "state.sqlite3"
    _version_3_database(path, environment_log=False)
    store = Store(path)
    try:
        assert "environment_log" in store.reader.tables()  # the schema's, not the log's own
        envlog = EnvironmentLog(store)
        snapshot = EnvSnapshot(python="3.11.7", packages={"torch": "2.9.0"}, checked=("torch",))
        envlog.record_start("vllm.service", "inv-9", snapshot, 5.0)
        assert envlog.for_invocation("vllm.service", "inv-9") == snapshot
    finally:
        store.close()
