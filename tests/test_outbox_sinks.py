"""Sinks as plug-ins: two edge sinks told about one crash each get their own message, exactly
once; the outbox's rows are keyed by sink; a state database of the release before sinks had
names upgrades in place and delivers what it still held."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from conftest import poll
from notify_fakes import make_outcome, running
from slack_server import SlackServer

from vllm_supervisor.config import Config, Secret, SlackConfig
from vllm_supervisor.errors import StateError
from vllm_supervisor.migrations import VERSION
from vllm_supervisor.notify.fanout import build_notifications, discover
from vllm_supervisor.notify.outbox import Outbox
from vllm_supervisor.notify.slack import SlackSink
from vllm_supervisor.notify.webhook import SlackWebhook
from vllm_supervisor.store import Checkpoint, Store
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

# The schema as the release before versioned migrations made it (store.py, notify/queue.py,
# notify/alertmanager.py at that time), verbatim but for comments.
PREVIOUS_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE unit_state (unit TEXT PRIMARY KEY, state TEXT NOT NULL);
CREATE TABLE history (
    id INTEGER PRIMARY KEY, unit TEXT, invocation_id TEXT, time REAL NOT NULL,
    outcome TEXT NOT NULL, notified INTEGER NOT NULL DEFAULT 0, UNIQUE (unit, invocation_id)
);
CREATE TABLE outbox (
    id INTEGER PRIMARY KEY, group_key TEXT, created REAL NOT NULL, due REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0, state TEXT NOT NULL DEFAULT 'pending', sent_at REAL,
    payload TEXT NOT NULL, last_error TEXT
);
CREATE INDEX outbox_pending ON outbox (state, due);
CREATE TABLE outbox_member (
    id INTEGER PRIMARY KEY, message_id INTEGER NOT NULL, unit TEXT, invocation_id TEXT,
    dedupe_key TEXT, time REAL NOT NULL
);
CREATE UNIQUE INDEX outbox_member_key ON outbox_member (ifnull(unit, ''), dedupe_key);
CREATE INDEX outbox_member_message ON outbox_member (message_id);
CREATE TABLE alert_firing (unit TEXT PRIMARY KEY, labels TEXT NOT NULL);
"""


@pytest.fixture(name="servers")
def _servers() -> Iterator[tuple[SlackServer, SlackServer]]:
    first, second = SlackServer(), SlackServer()
    first.start()
    second.start()
    yield first, second
    first.stop()
    second.stop()


def _lane(store: Store, server: SlackServer, name: str, metrics: Metrics) -> Outbox:
    sink = SlackSink(SlackWebhook(Secret(server.url)), SlackConfig(), name=name)
    return Outbox(store, sink, metrics, host="h")


async def test_a_second_sink_gets_its_own_message_for_the_same_crash(
    tmp_path: Path, servers: tuple[SlackServer, SlackServer]
) -> None:
    """One crash, two edge sinks on one state database: both are told, once each, and a
    replay of the batch queues nothing for either."""
    first, second = servers
    store = Store(tmp_path / "state.db")
    metrics = Metrics(new_registry(process=False))
    lanes = [_lane(store, first, "slack", metrics), _lane(store, second, "ops", metrics)]
    outcome = make_outcome()
    for _ in range(2):  # the same batch read again after a kill
        store.commit_batch(
            checkpoint=Checkpoint(cursor="c1"),
            outcomes=[outcome],
            extra=[lane.writer_for(outcome) for lane in lanes],
        )
    async with running(lanes[0]), running(lanes[1]):
        await poll(lambda: len(first.requests) == 1 and len(second.requests) == 1)
    assert (len(first.requests), len(second.requests)) == (1, 1)
    for sink in ("slack", "ops"):
        sent = metrics.registry.get_sample_value(
            "vllm_supervisor_notifications_total", {"sink": sink, "outcome": "sent"}
        )
        assert sent == 1, sink
    assert store.history()[0]["notified"] is True


def _previous_release_database(path: Path, payload: dict[str, object]) -> None:
    """A database as the release before migrations left it: one crash recorded, its Slack
    message still pending, one alert firing."""
    db = sqlite3.connect(path)
    db.executescript(PREVIOUS_SCHEMA)
    outcome = make_outcome().to_json()
    db.execute(
        "INSERT INTO history (unit, invocation_id, time, outcome) VALUES (?, ?, ?, ?)",
        ("vllm.service", "inv-1", 1.0, json.dumps(outcome)),
    )
    db.execute(
        "INSERT INTO outbox (id, group_key, created, due, payload) VALUES (1, NULL, 1.0, 1.0, ?)",
        (json.dumps(payload),),
    )
    db.execute(
        "INSERT INTO outbox_member (message_id, unit, invocation_id, dedupe_key, time)"
        " VALUES (1, 'vllm.service', 'inv-1', 'inv-1', 1.0)"
    )
    db.execute(
        "INSERT INTO alert_firing (unit, labels) VALUES ('vllm.service', ?)",
        (json.dumps({"alertname": "VllmSupervisorUnitHalted", "unit": "vllm.service"}),),
    )
    db.commit()
    db.close()


async def test_a_database_of_the_previous_release_upgrades_and_delivers_what_it_held(
    tmp_path: Path, servers: tuple[SlackServer, SlackServer]
) -> None:
    """The pending message is Slack's after the upgrade and goes out once; the crash is then
    notified; the firing alert is Alertmanager's open incident; a second sink's message for
    the same crash is no longer a replay."""
    slack, ops = servers
    path = tmp_path / "state.sqlite3"
    _previous_release_database(path, {"text": "queued before the upgrade"})
    store = Store(path)
    assert store.query("PRAGMA user_version") == [(VERSION,)]
    assert store.query("SELECT sink, unit FROM incident") == [("alertmanager", "vllm.service")]
    metrics = Metrics(new_registry(process=False))
    lane = _lane(store, slack, "slack", metrics)
    async with running(lane):
        await poll(lambda: store.history()[0]["notified"])
    assert [r.json() for r in slack.requests] == [{"text": "queued before the upgrade"}]
    second = _lane(store, ops, "ops", metrics)
    outcome = make_outcome()
    store.commit_batch(
        checkpoint=Checkpoint(cursor="c2"), outcomes=[outcome], extra=[second.writer_for(outcome)]
    )
    assert second.depth() == 1
    store.close()
    assert Store(path).query("PRAGMA user_version") == [(VERSION,)]  # opened again: no-op


def test_a_database_from_a_newer_release_is_refused_in_one_line(tmp_path: Path) -> None:
    """Its schema number is higher than this release knows: one error naming both numbers."""
    path = tmp_path / "state.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {VERSION + 1}")
    db.close()
    with pytest.raises(StateError, match=rf"schema {VERSION + 1}; this one knows up to {VERSION}"):
        Store(path)


def test_every_sink_module_is_a_plug_in_built_off_when_not_configured(tmp_path: Path) -> None:
    """Slack and Alertmanager are found as plug-ins, one edge and one level sink; without a
    URL both are built off, and /healthz names them."""
    names = {factory(Config()).name for factory in discover()}
    assert {"slack", "alertmanager"} <= names
    store = Store(tmp_path / "state.db")
    notify = build_notifications(
        Config(), store=store, metrics=Metrics(new_registry(process=False)), quarantined=dict
    )
    states = {name: state().state for name, state in notify.states().items()}
    assert states["slack"] == "off"
    assert states["alertmanager"] == "off"
    assert notify.edge("slack") is not None


async def test_a_sink_that_is_off_sends_nothing_and_says_nothing(tmp_path: Path) -> None:
    """Alertmanager without a URL and a unit halted: a round reads nothing, sends nothing and
    logs nothing, and its loop only waits to be stopped."""
    store = Store(tmp_path / "state.db")
    read: list[str] = []

    def quarantined() -> dict[str, dict[str, str]]:
        read.append("read")
        return {"vllm.service": {"signature": "x"}}

    notify = build_notifications(
        Config(), store=store, metrics=Metrics(new_registry(process=False)), quarantined=quarantined
    )
    (level,) = notify.levels
    with structlog.testing.capture_logs() as logs:
        assert await level.reconcile() is True
        stop = asyncio.Event()
        task = asyncio.create_task(level.run(stop))
        stop.set()
        await asyncio.wait_for(task, timeout=5)
    assert (logs, read) == ([], [])
    assert store.query("SELECT count(*) FROM incident") == [(0,)]
