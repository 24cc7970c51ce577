"""Whatever the state database's rows hold, the daemon starts and the commands answer.

The database is a file on disk: a person's `sqlite3` session, a restore from another release or
a bit flipped in a row can leave any SQLite value (text that is not JSON, JSON of another shape,
a number of 400 digits, a blob) where the daemon wrote its own. A row it cannot read is left
out, with a line; it never stops the daemon from starting, `history` and `status` from
answering, or the Alertmanager sink from sending.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import poll
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from notify_fakes import slack_outbox
from slack_server import SlackServer

from vllm_supervisor import cli
from vllm_supervisor.actions.actor import Actor
from vllm_supervisor.actions.halt import Halter
from vllm_supervisor.actions.quarantine import Quarantine
from vllm_supervisor.app import compose_daemon
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.config import AlertmanagerConfig, Config, Secret, SlackConfig, load_config
from vllm_supervisor.environment.log import EnvironmentLog
from vllm_supervisor.errors import StateError
from vllm_supervisor.journal.writer import crashed_invocation
from vllm_supervisor.notify.alertmanager import AlertmanagerSink
from vllm_supervisor.notify.level import LevelLoop
from vllm_supervisor.notify.queue import OutboxTable
from vllm_supervisor.notify.webhook import SlackWebhook
from vllm_supervisor.store import DATABASE_NAME, Store
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

UNIT = "vllm.service"
CRASH = "RuntimeError: CUDA error: an illegal memory access was encountered"

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
# Any value SQLite keeps in a column, whatever the column's declared type.
SQL_VALUE = st.one_of(
    JSON.map(lambda v: json.dumps(v)),
    st.sampled_from(
        [
            '{"ran_s": 1' + "0" * 400 + "}",
            '{"count": 1e999, "ran_s": NaN}',
            '{"verdict": 1}',
            "[]",
            "not json",
            "[" * 4000,  # past the JSON parser's recursion limit
        ]
    ),
    st.text(max_size=30),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False),  # SQLite stores NaN as NULL, which the columns refuse
    st.binary(max_size=20),
)
TABLE_ROWS = st.fixed_dictionaries(
    {
        "cursor": st.none() | SQL_VALUE,
        "unit_state": st.lists(SQL_VALUE, max_size=2),
        "history": st.lists(st.tuples(SQL_VALUE, SQL_VALUE), max_size=3),
        "incident": st.lists(SQL_VALUE, max_size=2),
    }
)


def _plant(state_dir: Path, rows: dict[str, Any]) -> None:
    """A database this release made, then rows written behind its back."""
    Store.in_directory(state_dir).close()
    db = sqlite3.connect(state_dir / DATABASE_NAME, isolation_level=None)
    try:
        if rows["cursor"] is not None:
            db.execute("INSERT INTO meta VALUES ('cursor', ?)", (rows["cursor"],))
        for index, state in enumerate(rows["unit_state"]):
            db.execute("INSERT INTO unit_state VALUES (?, ?)", (f"u{index}.service", state))
        for index, (when, outcome) in enumerate(rows["history"]):
            db.execute(
                "INSERT INTO history (unit, invocation_id, time, outcome) VALUES (?, ?, ?, ?)",
                (UNIT, f"inv{index}", when, outcome),
            )
        for index, identity in enumerate(rows["incident"]):
            db.execute(
                "INSERT INTO incident (sink, unit, identity) VALUES ('alertmanager', ?, ?)",
                (f"u{index}.service", identity),
            )
    finally:
        db.close()


def _config_file(root: Path) -> Path:
    path = root / "supervisor.toml"
    path.write_text(
        f'[systemd]\nenabled = false\n[metrics]\nenabled = false\n[journal]\ndirectory = "{root}"\n'
        f'[state]\nstate_dir = "{root / "state"}"\nruntime_dir = "{root / "run"}"\n'
        f'[[unit]]\nname = "{UNIT}"\n',
        encoding="utf-8",
    )
    return path


def _command(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main(argv)
    return code, out.getvalue()


def _compose(config: Config, store: Store) -> None:
    """The daemon's parts, built from the database as at a start."""
    metrics = Metrics(new_registry(process=False))
    halter = Halter(
        Quarantine(config.state.runtime_dir / "quarantine"), None, attempts=1, timeout_s=1
    )
    compose_daemon(
        config, load_table(config), store=store, metrics=metrics, actor=Actor(halter, None, metrics)
    )


async def _one_alertmanager_round(store: Store) -> None:
    """One round of the sink against a closed port: read what it sent, render, try to send."""
    sink = LevelLoop(
        AlertmanagerSink(AlertmanagerConfig(url="http://127.0.0.1:9/", timeout_s=1), host="h"),
        store,
        dict,
    )
    await sink.reconcile()
    await sink.sink.aclose()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=TABLE_ROWS)
@example(rows={"cursor": 7, "unit_state": [], "history": [], "incident": []})
@example(
    rows={
        "cursor": None,
        "unit_state": ['{"ran_s": 1' + "0" * 400 + "}", "not json"],
        "history": [],
        "incident": [],
    }
)
@example(rows={"cursor": None, "unit_state": [], "history": [("x", "[]")], "incident": []})
@example(rows={"cursor": None, "unit_state": [], "history": [], "incident": ["not json"]})
def test_any_rows_let_the_daemon_start_and_the_commands_answer(rows: dict[str, Any]) -> None:
    """The daemon's parts are built, `history` (text and JSON) and `status` answer without the
    last net's line, and the Alertmanager sink's round returns."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config_path = _config_file(root)
        _plant(root / "state", rows)
        config = load_config(config_path)
        store = Store.in_directory(config.state.state_dir)
        try:
            checkpoint = store.load_checkpoint()
            assert checkpoint.cursor is None or isinstance(checkpoint.cursor, str)
            _compose(config, store)
            asyncio.run(_one_alertmanager_round(store))
        finally:
            store.close()
        for argv in (
            ["history", "--config", str(config_path)],
            ["history", "--config", str(config_path), "--format", "json"],
            ["status", "--config", str(config_path), "--format", "json"],
        ):
            code, output = _command(argv)
            assert cli.UNEXPECTED not in output, (argv, output)
            assert "Traceback" not in output, (argv, output)
            assert code in (0, 1, 3), (argv, code, output)


CRASH_ID = "c" * 32
SNAPSHOT = json.dumps({"python": "3.11.7", "packages": {"torch": "2.5.0"}})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=SQL_VALUE | st.just(SNAPSHOT), this=SQL_VALUE | st.just(SNAPSHOT))
@example(base='{"packages": []}', this=SNAPSHOT)
@example(base=SNAPSHOT, this="[]")
def test_any_environment_rows_leave_triage_and_preflight_answering(base: Any, this: Any) -> None:
    """The environments the daemon recorded are read back to report drift: a row that is not
    a snapshot leaves drift out; `triage` still reports the crash."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config_path = _config_file(root)
        state = root / "state"
        Store.in_directory(state).close()
        db = sqlite3.connect(state / DATABASE_NAME, isolation_level=None)
        db.executemany(
            "INSERT INTO environment_log (unit, invocation_id, started, snapshot, good)"
            " VALUES (?, ?, ?, ?, ?)",
            [(UNIT, "b" * 32, 1.0, base, 1), (UNIT, CRASH_ID, 2.0, this, 0)],
        )
        db.close()
        journal = root / "journal.json"
        journal.write_text(
            "".join(
                json.dumps({"__CURSOR": f"c{i}", "__REALTIME_TIMESTAMP": str(i + 1)} | fields)
                + "\n"
                for i, fields in enumerate(
                    {k: str(v) for k, v in entry.items()}
                    for entry in crashed_invocation(UNIT, [CRASH], invocation_id=CRASH_ID)
                )
            ),
            encoding="utf-8",
        )
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()) as err:
            code = cli.main(
                ["triage", str(journal), "--config", str(config_path), "--format", "json"]
            )
        assert cli.UNEXPECTED not in err.getvalue(), err.getvalue()
        assert code == 0, err.getvalue()
        assert len(json.loads(out.getvalue())["invocations"]) == 1
        store = Store.in_directory(state)
        try:
            EnvironmentLog(store).last_good(UNIT)
        except StateError:
            pass
        finally:
            store.close()


GOOD_PAYLOAD = json.dumps({"text": "the good one"})


@pytest.fixture(name="slack_server", scope="module")
def _slack_server() -> Iterator[SlackServer]:
    server = SlackServer()
    server.start()
    yield server
    server.stop()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(
        st.tuples(
            SQL_VALUE | st.sampled_from([-1.0, 0.0]),
            SQL_VALUE | st.sampled_from([0, 3]),
            SQL_VALUE | st.just(GOOD_PAYLOAD),
            st.sampled_from(["pending", "sending"]),
        ),
        min_size=1,
        max_size=3,
    )
)
@example(rows=[("soon", 0, GOOD_PAYLOAD, "pending")])
@example(rows=[(-1.0, "x", GOOD_PAYLOAD, "pending")])
@example(rows=[(-1.0, 0, "7", "pending")])
@example(rows=[(-1.0, 0, "[]", "sending")])
@example(rows=[("", 2**63 - 1, "{}", "pending")])
def test_any_outbox_rows_leave_the_next_message_delivered(
    slack_server: SlackServer, rows: list[tuple[Any, Any, Any, str]]
) -> None:
    """Messages queued behind the outbox's back, of any shape: the delivery loop goes on and
    the message queued after them is posted."""
    slack_server.requests.clear()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store.in_directory(Path(tmp))
        now = time.time()  # older messages are pruned before anything is sent
        store.write_blocking(
            lambda db: db.executemany(
                "INSERT INTO outbox (created, due, attempts, state, payload)"
                " VALUES (?, ?, ?, ?, ?)",
                [(now, due, attempts, state, payload) for due, attempts, payload, state in rows]
                + [(now, 0.0, 0, "pending", GOOD_PAYLOAD)],
            )
        )
        try:
            asyncio.run(_deliver_until_the_good_one(store, slack_server))
        finally:
            store.close()


def _all_looked_at(store: Store, server: SlackServer) -> bool:
    """The good message was posted, and every message due by now was tried at least once."""
    untried = store.query(
        "SELECT count(*) FROM outbox WHERE state IN ('pending', 'sending') AND last_error IS NULL"
        " AND NOT (typeof(due) IN ('integer', 'real') AND due > ?)",
        (time.time(),),
    )[0][0]
    posted = any(r.json() == json.loads(GOOD_PAYLOAD) for r in list(server.requests))
    return posted and untried == 0


async def _deliver_until_the_good_one(store: Store, server: SlackServer) -> None:
    outbox = slack_outbox(
        store,
        SlackWebhook(Secret(server.url), timeout_s=2),
        Metrics(new_registry(process=False)),
        SlackConfig(min_interval_s=0.0, backoff_max_s=0.1),
        host="h",
    )
    stop = asyncio.Event()
    task = asyncio.create_task(outbox.run(stop))
    try:
        await poll(lambda: task.done() or _all_looked_at(store, server), within=20)
        assert not task.done(), task
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await outbox.sink.aclose()


def test_the_next_message_is_picked_through_the_index_whatever_the_backlog(tmp_path: Path) -> None:
    """During a long Slack outage the outbox holds thousands of pending rows, and the delivery
    loop picks the next one after each attempt: every query it makes for that walks the
    (sink, state, due) index; none sorts the pending rows (an expression in ORDER BY
    made SQLite do so). A row whose due was edited to text is still picked first."""
    store = Store.in_directory(tmp_path)
    now = time.time()
    store.write_blocking(
        lambda db: db.executemany(
            "INSERT INTO outbox (created, due, attempts, state, payload) VALUES (?, ?, 0, ?, ?)",
            [(now, now + n, "pending", GOOD_PAYLOAD) for n in range(2000)]
            + [(now, "edited", "pending", json.dumps({"text": "edited"}))],
        )
    )
    asked: list[str] = []

    def pick(db: sqlite3.Connection) -> Any:
        db.set_trace_callback(asked.append)
        try:
            return OutboxTable(db, "slack").next_due([])
        finally:
            db.set_trace_callback(None)

    try:
        picked = store.write_blocking(pick)
        assert picked is not None and json.loads(picked.payload) == {"text": "edited"}
        selects = [sql for sql in asked if sql.lstrip().upper().startswith("SELECT")]
        assert selects
        for sql in selects:
            plan = " | ".join(row[-1] for row in store.query(f"EXPLAIN QUERY PLAN {sql}"))
            assert "outbox_pending" in plan and "TEMP B-TREE" not in plan, plan
    finally:
        store.close()
