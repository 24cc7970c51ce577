"""The state database's schema, as numbered steps: a database any release wrote opens and upgrades.

`PRAGMA user_version` is the number of the last step applied. Step 1 is the schema as it was
before there were versions (every table `CREATE ... IF NOT EXISTS`, so a database of that time,
which says 0, takes it as a no-op); each later step changes what the one before left. All steps
still to apply run in one transaction with the new number, so an upgrade cut short leaves the
old schema and its data as they were. A database from a newer release (a higher number) is
refused: this release would misread it.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from .errors import StateError

# 1: the tables as the releases before versioning made them, each where it was made then.
_V1 = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS unit_state (unit TEXT PRIMARY KEY, state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS history (
    id INTEGER PRIMARY KEY,
    unit TEXT,
    invocation_id TEXT,
    time REAL NOT NULL,
    outcome TEXT NOT NULL,
    notified INTEGER NOT NULL DEFAULT 0,
    UNIQUE (unit, invocation_id)
);
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY,
    group_key TEXT,
    created REAL NOT NULL,
    due REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    state TEXT NOT NULL DEFAULT 'pending',
    sent_at REAL,
    payload TEXT NOT NULL,
    last_error TEXT
);
CREATE INDEX IF NOT EXISTS outbox_pending ON outbox (state, due);
CREATE TABLE IF NOT EXISTS outbox_member (
    id INTEGER PRIMARY KEY,
    message_id INTEGER NOT NULL,
    unit TEXT,
    invocation_id TEXT,
    dedupe_key TEXT,
    time REAL NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS outbox_member_key
    ON outbox_member (ifnull(unit, ''), dedupe_key);
CREATE INDEX IF NOT EXISTS outbox_member_message ON outbox_member (message_id);
CREATE TABLE IF NOT EXISTS alert_firing (unit TEXT PRIMARY KEY, labels TEXT NOT NULL);
"""

# 2: messages and their crashes belong to a sink; before, every row was Slack's. The
# Alertmanager's firing alerts become the level-triggered sinks' open incidents.
_V2 = """
ALTER TABLE outbox ADD COLUMN sink TEXT NOT NULL DEFAULT 'slack';
ALTER TABLE outbox_member ADD COLUMN sink TEXT NOT NULL DEFAULT 'slack';
DROP INDEX outbox_member_key;
CREATE UNIQUE INDEX outbox_member_key ON outbox_member (sink, ifnull(unit, ''), dedupe_key);
DROP INDEX outbox_pending;
CREATE INDEX outbox_pending ON outbox (sink, state, due);
CREATE TABLE incident (
    sink TEXT NOT NULL,
    unit TEXT NOT NULL,
    identity TEXT NOT NULL,
    PRIMARY KEY (sink, unit)
);
INSERT INTO incident (sink, unit, identity) SELECT 'alertmanager', unit, labels FROM alert_firing;
DROP TABLE alert_firing;
"""

# 3: an invocation ended and not yet decided, or an action decided and not yet carried out, as
# supervisor.records writes them (the daemon decides or carries it out at its next start).
# `IF NOT EXISTS`: a database of the one build that made this table before the schema had
# versions says 1 or 0 and has it.
_V3 = """
CREATE TABLE IF NOT EXISTS pending_action (
    id INTEGER PRIMARY KEY,
    unit TEXT,
    key TEXT NOT NULL,
    outcome TEXT NOT NULL,
    UNIQUE (unit, key)
);
"""

# 4: the environment log (supervisor.environment.log), which made its own table before; a
# database that has it (any the daemon ran on) keeps it and its rows as they are.
_V4 = """
CREATE TABLE IF NOT EXISTS environment_log (
    unit TEXT NOT NULL,
    invocation_id TEXT NOT NULL,
    started REAL NOT NULL,
    snapshot TEXT NOT NULL,
    good INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (unit, invocation_id)
);
CREATE INDEX IF NOT EXISTS environment_log_unit_started ON environment_log (unit, started);
"""

STEPS: tuple[str, ...] = (_V1, _V2, _V3, _V4)
VERSION = len(STEPS)


def migrate(connection: sqlite3.Connection, path: Path) -> int:
    """Bring the database up to VERSION; the version it had. StateError when it is newer."""
    (found,) = connection.execute("PRAGMA user_version").fetchone()
    if found > VERSION:
        raise StateError(
            f"{path}: written by a newer vllm-supervisor (schema {found}; this one knows up to "
            f"{VERSION}): run that release, or move the database aside"
        )
    if found == VERSION:
        return int(found)
    connection.execute("BEGIN IMMEDIATE")
    try:
        for step in STEPS[found:]:
            for statement in _statements(step):
                connection.execute(statement)
        connection.execute(f"PRAGMA user_version = {VERSION}")
    except BaseException:
        connection.execute("ROLLBACK")
        raise
    connection.execute("COMMIT")
    return int(found)


def _statements(script: str) -> list[str]:
    """The statements of a step (executescript would commit the transaction they belong to)."""
    return [s.strip() for s in script.split(";") if s.strip()]
