"""The daemon on a real journal: halts, checkpoints, and a restart in the middle of a crash."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from pathlib import Path

import structlog
import structlog.testing
from conftest import poll
from notify_fakes import slack_outbox
from slack_server import Reply, SlackServer

from vllm_supervisor.actions.actor import Actor
from vllm_supervisor.actions.halt import Halter
from vllm_supervisor.actions.quarantine import Quarantine, quarantine_dir
from vllm_supervisor.app import close_within, compose_daemon
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.demo import DEMO_UNIT, demo_config, seed_lines
from vllm_supervisor.config import Config, Secret, SlackConfig
from vllm_supervisor.daemon import Daemon
from vllm_supervisor.journal.writer import JournalWriter, crashed_invocation
from vllm_supervisor.model import Invocation, JournalEntry
from vllm_supervisor.notify.outbox import Outbox
from vllm_supervisor.notify.webhook import SlackWebhook
from vllm_supervisor.store import Store
from vllm_supervisor.telemetry.metrics import Metrics, new_registry


def _config(root: Path) -> Config:
    return dataclasses.replace(
        demo_config(root), metrics=dataclasses.replace(demo_config(root).metrics, enabled=False)
    )


async def _run_until(config: Config, writer: JournalWriter, history_len: int) -> list[dict]:
    """Run a fresh daemon until the history holds `history_len` invocations, then stop it."""
    store = Store.in_directory(config.state.state_dir)
    halter = Halter(Quarantine(quarantine_dir(config)), None, attempts=1, timeout_s=1)
    metrics = Metrics(new_registry(process=False))
    daemon = compose_daemon(
        config,
        load_table(config),
        store=store,
        metrics=metrics,
        actor=Actor(halter, None, metrics),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(daemon.run(stop))
    try:
        await poll(
            lambda: task.done() or len(store.history()) >= history_len,
            within=30,
            each=writer.nudge,
        )
        assert not task.done(), task
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    items = store.history()
    store.close()
    return items


async def test_restart_inside_an_invocation_loses_and_repeats_nothing(tmp_path: Path) -> None:
    """Stopping the daemon mid-crash and starting a new one still sees the whole invocation once."""
    config = _config(tmp_path)
    lines = seed_lines()
    inv = uuid.uuid4().hex
    first = crashed_invocation(DEMO_UNIT, lines, restarts=1)
    crash = crashed_invocation(DEMO_UNIT, lines, restarts=2, invocation_id=inv)
    half = len(crash) // 2  # the root cause sits in the first half of the seed log
    with JournalWriter(config.journal.directory) as writer:  # type: ignore[arg-type]
        writer.write(first + crash[:half])
        before = await _run_until(config, writer, 1)
        assert Store.in_directory(config.state.state_dir).load_checkpoint().replay_from
        writer.write(crash[half:])
        after = await _run_until(config, writer, 2)
    assert len(before) == 1
    assert [i["invocation_id"] for i in after].count(inv) == 1
    last = after[-1]
    assert last["verdict"]["signature"] == "flashinfer_cubin_mismatch"
    assert last["lines"] == len(lines)
    assert last["decision"]["action"] == "halt"
    assert (quarantine_dir(config) / f"{DEMO_UNIT}.json").exists()


async def test_restart_after_the_end_does_not_act_twice(tmp_path: Path) -> None:
    """A daemon restarted on the same journal neither repeats nor forgets a crash."""
    config = _config(tmp_path)
    with JournalWriter(config.journal.directory) as writer:  # type: ignore[arg-type]
        writer.write(crashed_invocation(DEMO_UNIT, seed_lines(), restarts=1))
        await _run_until(config, writer, 1)
        writer.write(crashed_invocation(DEMO_UNIT, ["RuntimeError: something new"], restarts=2))
        items = await _run_until(config, writer, 2)
    assert len(items) == 2
    assert len({i["invocation_id"] for i in items}) == 2


async def test_cursor_only_batches_commit_at_most_each_interval_and_when_quiet(
    tmp_path: Path,
) -> None:
    """Without a decision, the cursor is committed at most every checkpoint_interval_s, and
    at the latest that long after the journal goes quiet; a decision is committed at once."""
    base = _config(tmp_path)
    config = dataclasses.replace(
        base, state=dataclasses.replace(base.state, checkpoint_interval_s=0.5)
    )
    store = Store.in_directory(config.state.state_dir)
    daemon = compose_daemon(
        config, load_table(config), store=store, metrics=Metrics(new_registry(process=False))
    )
    commits: list[str | None] = []
    commit_batch = store.acommit_batch

    async def counting(**kwargs: object) -> None:
        await commit_batch(**kwargs)  # type: ignore[arg-type]
        commits.append(store.load_checkpoint().cursor)

    store.acommit_batch = counting  # type: ignore[method-assign]
    inv = uuid.uuid4().hex
    crash = crashed_invocation(DEMO_UNIT, seed_lines(), restarts=1, invocation_id=inv)
    stop = asyncio.Event()
    with JournalWriter(config.journal.directory) as writer:  # type: ignore[arg-type]
        writer.write(crash[:2])
        task = asyncio.create_task(daemon.run(stop))
        try:
            await poll(lambda: daemon.reader.following.is_set(), within=15, each=writer.nudge)
            for line in crash[2:-3]:  # one batch per line, no decision among them
                writer.write([line])
                writer.nudge()
                await asyncio.sleep(0.005)  # the traffic's pace, not a synchronisation
            await poll(lambda: commits and commits[-1] == daemon.reader.cursor, within=5)
            lines_commits = len(commits)
            writer.write(crash[-3:])  # the end: a decision
            await poll(lambda: len(store.history()) == 1, within=10, each=writer.nudge)
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
    store.close()
    # ~200 one-line batches in about a second: a handful of commits, not one per batch.
    assert 1 <= lines_commits <= 6, commits
    assert len(commits) >= lines_commits + 1


async def test_an_entry_whose_handling_raises_is_counted_and_skipped(tmp_path: Path) -> None:
    """The last guard: an exception while tracking one entry (injected: the tracker is total)
    is counted in journal_entries_invalid_total{reason="pipeline_error"}, and the entries after
    it, read from a real journal, are still handled."""
    config = _config(tmp_path)
    store = Store.in_directory(config.state.state_dir)
    metrics = Metrics(new_registry(process=False))
    daemon = compose_daemon(config, load_table(config), store=store, metrics=metrics)
    feed = daemon.pipeline.tracker.feed
    calls = 0

    def first_one_raises(entry: JournalEntry) -> list[Invocation]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("injected")
        return feed(entry)

    daemon.pipeline.tracker.feed = first_one_raises  # type: ignore[method-assign]
    stop = asyncio.Event()
    with JournalWriter(config.journal.directory) as writer:
        writer.write(crashed_invocation(DEMO_UNIT, seed_lines(), restarts=1))
        task = asyncio.create_task(daemon.run(stop))
        try:
            await poll(lambda: task.done() or store.history(), within=30, each=writer.nudge)
            assert not task.done(), task
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
    skipped = metrics.registry.get_sample_value(
        "vllm_supervisor_journal_entries_invalid_total", {"reason": "pipeline_error"}
    )
    (crash,) = store.history()
    store.close()
    assert skipped == 1.0
    assert crash["verdict"]["signature"] == "flashinfer_cubin_mismatch"


def _with_slack(
    config: Config, store: Store, server: SlackServer, slack: SlackConfig, *, grace_s: float = 10
) -> tuple[Daemon, Outbox]:
    """A daemon without systemd whose outbox posts to the loopback Slack `server`."""
    metrics = Metrics(new_registry(process=False))
    hook = SlackWebhook(Secret(server.url), timeout_s=slack.timeout_s)
    outbox = slack_outbox(store, hook, metrics, slack, host="h")
    halter = Halter(Quarantine(quarantine_dir(config)), None, attempts=1, timeout_s=1)
    daemon = compose_daemon(
        config,
        load_table(config),
        store=store,
        metrics=metrics,
        actor=Actor(halter, None, metrics),
        notifier=outbox,
        shutdown_grace_s=grace_s,
    )
    return daemon, outbox


async def test_a_stop_during_a_hung_slack_attempt_ends_within_the_grace(tmp_path: Path) -> None:
    """SIGTERM while Slack holds a request: the daemon cancels the attempt after its grace,
    says so in one line, and the message stays in the outbox for the next start."""
    config = _config(tmp_path)
    server = SlackServer()
    server.start()
    server.script.append(Reply(delay_s=60))  # Slack takes the request and never answers in time
    store = Store.in_directory(config.state.state_dir)
    daemon, outbox = _with_slack(config, store, server, SlackConfig(timeout_s=30), grace_s=0.5)
    stop = asyncio.Event()
    try:
        with JournalWriter(config.journal.directory) as writer:  # type: ignore[arg-type]
            writer.write(crashed_invocation(DEMO_UNIT, seed_lines(), restarts=1))
            with structlog.testing.capture_logs() as logs:
                task = asyncio.create_task(daemon.run(stop))
                await poll(lambda: bool(server.requests), within=30, each=writer.nudge)
                stop.set()
                stopped_at = asyncio.get_running_loop().time()
                await asyncio.wait_for(task, 10)
                took = asyncio.get_running_loop().time() - stopped_at
    finally:
        server.stop()
    assert took < 5, f"stop took {took:.1f}s with a grace of 0.5s"
    cancelled = [e for e in logs if e["event"] == "shutdown_cancelled"]
    assert [e["tasks"] for e in cancelled] == [["notifier"]]
    assert outbox.depth() == 1  # not lost: delivered by the next daemon
    store.close()


async def test_closing_is_bounded_as_a_whole() -> None:
    """A close that hangs (a bus that never answers) or fails never holds the others or the
    stop past the budget."""
    closed: list[str] = []

    async def hangs() -> None:
        await asyncio.Event().wait()

    async def fails() -> None:
        raise OSError("socket already gone")

    async def closes() -> None:
        closed.append("server")

    loop = asyncio.get_running_loop()
    started = loop.time()
    with structlog.testing.capture_logs() as logs:
        await close_within(0.3, [hangs(), fails(), closes()])
    assert loop.time() - started < 2
    assert closed == ["server"]
    assert [e["count"] for e in logs if e["event"] == "close_timed_out"] == [1]


async def test_a_fatal_loop_is_one_story_one_halt_one_message(tmp_path: Path) -> None:
    """Three crashes of one fatal loop (the gate bypassed, as the demo's journal is written at
    once): one halt, one Slack message saying how many crashes it took and how to see the log;
    the later crashes join the standing record and are not told again."""
    config = _config(tmp_path)
    server = SlackServer()
    server.start()
    store = Store.in_directory(config.state.state_dir)
    daemon, _ = _with_slack(config, store, server, SlackConfig(min_interval_s=0.01))
    ids = [uuid.uuid4().hex for _ in range(3)]
    stop = asyncio.Event()
    try:
        with JournalWriter(config.journal.directory) as writer:  # type: ignore[arg-type]
            for restarts, inv in enumerate(ids):
                writer.write(
                    crashed_invocation(
                        DEMO_UNIT, seed_lines(), restarts=restarts, invocation_id=inv
                    )
                )
            task = asyncio.create_task(daemon.run(stop))
            await poll(
                lambda: len(store.history()) == 3 and all(h["notified"] for h in store.history()),
                within=30,
                each=writer.nudge,
            )
            stop.set()
            await asyncio.wait_for(task, 15)
    finally:
        server.stop()
    history = store.history()
    assert [h["already_halted_by"] for h in history] == [None, ids[0], ids[0]]
    record = Quarantine(quarantine_dir(config)).read(DEMO_UNIT)
    assert record is not None
    assert (record["invocation_id"], record["crashes"], record["last_invocation_id"]) == (
        ids[0],
        3,
        ids[2],
    )
    (message,) = [r.json()["text"] for r in server.requests]
    assert "after 1 crash in a row" in message
    assert f"Log: journalctl -u {DEMO_UNIT} _SYSTEMD_INVOCATION_ID={ids[0]}" in message
    store.close()
