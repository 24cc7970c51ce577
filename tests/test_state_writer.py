"""One writer owns the state database: every write of the running daemon goes through its one
thread, never the event loop's, so a slow disk never stalls the loop."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
from conftest import poll
from notify_fakes import slack_outbox
from slack_server import SlackServer

from vllm_supervisor.app import compose_daemon
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.demo import DEMO_UNIT, demo_config, seed_lines
from vllm_supervisor.config import Config, Secret, SlackConfig
from vllm_supervisor.errors import StateError
from vllm_supervisor.journal.writer import JournalWriter, crashed_invocation
from vllm_supervisor.notify.webhook import SlackWebhook
from vllm_supervisor.store import Checkpoint, Store
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

SLOW_COMMIT_S = 0.5
MAX_LAG_RATIO = 0.5  # a commit on the loop shows as a lag of about its whole duration


def _config(root: Path) -> Config:
    config = demo_config(root)
    return dataclasses.replace(config, metrics=dataclasses.replace(config.metrics, enabled=False))


def slow_disk(store: Store, seconds: float, threads: list[int]) -> None:
    """Every commit of the store's writes takes `seconds` (a slow fsync), in the committing
    thread, which is noted."""

    def traced(statement: str) -> None:
        if statement.strip().upper() == "COMMIT":
            threads.append(threading.get_ident())
            time.sleep(seconds)

    assert store.writer is not None
    store.writer.connection.set_trace_callback(traced)


def _notified(state_dir: Path) -> Callable[[], bool]:
    def check() -> bool:
        reader = Store.existing_in_directory(state_dir)
        if reader is None:
            return False
        try:
            return [item["notified"] for item in reader.history()] == [True]
        finally:
            reader.close()

    return check


async def test_a_slow_disk_never_stalls_the_loop(tmp_path: Path) -> None:
    """A crash decided, halted, recorded and told on Slack: each commit takes half a second,
    yet all of them run in one thread that is not the loop's, and the loop's worst lag stays a
    small fraction of one commit."""
    config = _config(tmp_path)
    server = SlackServer()
    server.start()
    store = Store.in_directory(config.state.state_dir)
    commits: list[int] = []
    slow_disk(store, SLOW_COMMIT_S, commits)
    metrics = Metrics(new_registry(process=False))
    samples: list[float] = []
    record = metrics.loop_lag

    def noting(seconds: float) -> None:
        samples.append(seconds)
        record(seconds)

    metrics.loop_lag = noting  # type: ignore[method-assign]
    slack = SlackConfig(min_interval_s=0)
    outbox = slack_outbox(
        store, SlackWebhook(Secret(server.url), timeout_s=5), metrics, slack, host="h"
    )
    daemon = compose_daemon(
        config, load_table(config), store=store, metrics=metrics, notifier=outbox
    )
    crash = crashed_invocation(DEMO_UNIT, seed_lines(), restarts=1, invocation_id=uuid.uuid4().hex)
    stop = asyncio.Event()
    try:
        with JournalWriter(config.journal.directory) as writer:  # type: ignore[arg-type]
            writer.write(crash)
            task = asyncio.create_task(daemon.run(stop))
            try:
                notified = _notified(config.state.state_dir)
                await poll(notified, within=30, each=writer.nudge)
            finally:
                stop.set()
                await asyncio.wait_for(task, 15)
    finally:
        server.stop()
        store.close()
    loop_thread = threading.get_ident()
    assert len(server.requests) == 1
    assert len(commits) >= 3, commits  # the batch, its history and message, the message sent
    assert loop_thread not in commits
    assert len(set(commits)) == 1, "one writer thread"
    assert samples, "the probe sampled while the crash was handled"
    assert max(samples) / SLOW_COMMIT_S < MAX_LAG_RATIO, samples


class _Second:
    """A repository that claims a table another one owns."""

    TABLES: ClassVar[tuple[str, ...]] = ("history",)


class _Unmade:
    """A repository whose table no migration makes."""

    TABLES: ClassVar[tuple[str, ...]] = ("nowhere",)


class TestOneOwner:
    def test_a_table_has_one_repository_and_a_migration(self, tmp_path: Path) -> None:
        store = Store(tmp_path / "state.sqlite3")
        try:
            with pytest.raises(StateError, match="table history has two owners"):
                store.register(_Second)
            with pytest.raises(StateError, match="no table nowhere for _Unmade"):
                store.register(_Unmade)
        finally:
            store.close()

    async def test_work_is_one_transaction_in_one_thread_and_wakes_after_commit(
        self, tmp_path: Path
    ) -> None:
        """A unit of work that fails leaves nothing and calls no after-commit callback; one
        that succeeds is visible to the reader when its callback runs."""
        store = Store(tmp_path / "state.sqlite3")
        seen: list[tuple[int, list[Any]]] = []

        def note() -> None:
            seen.append((threading.get_ident(), store.query("SELECT key FROM meta")))

        def fails(db: sqlite3.Connection) -> None:
            db.execute("INSERT INTO meta VALUES ('cursor', 'c1')")
            store.after_commit(note)
            raise ValueError("halfway")

        def succeeds(db: sqlite3.Connection) -> int:
            db.execute("INSERT INTO meta VALUES ('cursor', 'c2')")
            store.after_commit(note)
            return threading.get_ident()

        try:
            with pytest.raises(ValueError, match="halfway"):
                await store.write(fails)
            assert store.load_checkpoint() == Checkpoint()
            writer_thread = await store.write(succeeds)
            assert store.load_checkpoint() == Checkpoint(cursor="c2")
        finally:
            store.close()
        assert writer_thread != threading.get_ident()
        assert seen == [(writer_thread, [("cursor",)])]

    def test_a_read_only_store_refuses_writes(self, tmp_path: Path) -> None:
        Store.in_directory(tmp_path).close()
        store = Store.read_only(tmp_path)
        try:
            with pytest.raises(StateError, match="opened read-only"):
                store.commit_batch(checkpoint=Checkpoint(cursor="c"))
            with pytest.raises(StateError):
                store.query("INSERT INTO meta VALUES ('cursor', 'c')")
        finally:
            store.close()
