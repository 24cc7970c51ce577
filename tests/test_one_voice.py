"""One host, one voice: a daemon reading a shared journal directory tells only its own host's
crashes (a real daemon child, a real journal, a Slack stand-in on loopback).

Seen before with two hosts' daemons reading one journal-remote directory: every crash was
posted twice, the other host's copy saying "read late". Another host's crash is now recorded
in history and told by that host's own daemon only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sqlite3
from pathlib import Path

from conftest import wait_for
from faults.harness import Supervisor, crash, write_config
from notify_fakes import make_outcome
from slack_server import SlackServer

from vllm_supervisor.errors import StateError
from vllm_supervisor.journal.writer import JournalWriter
from vllm_supervisor.model import Outcome, Rule, Taken
from vllm_supervisor.notify.decision import NotifyReason, telling
from vllm_supervisor.store import DATABASE_NAME, Store

OTHER_HOST = "0123456789abcdef0123456789abcdef"


def _history(state: Path) -> list[dict[str, object]]:
    """What the daemon recorded so far (nothing while its database is not there yet)."""
    store = Store.existing_in_directory(state)
    try:
        return [] if store is None else store.history()
    except StateError:  # made, not yet migrated: the daemon is starting
        return []


def _queued(state: Path) -> list[str]:
    """The invocations any message was queued for, from the daemon's outbox (read-only)."""
    with contextlib.closing(
        sqlite3.connect(f"file:{state / DATABASE_NAME}?mode=ro", uri=True)
    ) as db:
        return [row[0] for row in db.execute("SELECT invocation_id FROM outbox_member")]


def _elsewhere(entries: list[dict[str, object]]) -> list[dict[str, object]]:
    return [{**entry, "_MACHINE_ID": OTHER_HOST, "_HOSTNAME": "gpu-b"} for entry in entries]


def test_another_hosts_crash_is_recorded_and_not_told(tmp_path: Path, slack: SlackServer) -> None:
    config = write_config(tmp_path, slack_url=slack.url)
    # Crashes read late are held this long to be one message: here, not 10 s.
    text = config.read_text().replace(
        "min_interval_s = 0.01", "min_interval_s = 0.01\nbacklog_hold_s = 0.1"
    )
    config.write_text(text)
    sup = Supervisor(tmp_path, config, env={"DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/no/bus"})
    sup.start()
    try:
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(_elsewhere(crash("fatal", 1)) + crash("fatal", 2))  # type: ignore[arg-type]

            def both_recorded() -> bool:
                writer.nudge()
                return len(_history(tmp_path / "state")) >= 2 and slack.count() >= 1

            wait_for(both_recorded, timeout=60, what="both crashes recorded, one told")
            rules = {o["host"]: o["decision"]["rule"] for o in _history(tmp_path / "state")}
            assert rules["gpu-b"] == "other_host", rules
            local = next(o for o in _history(tmp_path / "state") if o["host"] != "gpu-b")
            assert local["taken"] != "recorded", local
            # Queued with its history row, in one transaction: none queued for gpu-b's crash.
            assert _queued(tmp_path / "state") == [local["invocation_id"]]
            wait_for(lambda: slack.idle(), timeout=10, what="Slack idle")
            assert slack.count() == 1, [r.json() for r in slack.requests]
            assert "0.6.2" in json.dumps(slack.requests[0].json())  # this host's crash
        assert sup.alive(), sup.stderr_text()
    finally:
        sup.stop_quietly()


def test_the_rule_says_elsewhere() -> None:
    """Whatever else it is, another host's recorded crash is told by its own host."""
    outcome: Outcome = make_outcome()
    other = dataclasses.replace(
        outcome,
        decision=dataclasses.replace(outcome.decision, rule=Rule.OTHER_HOST),
        taken=Taken.RECORDED,
    )
    assert telling(other, endpoint=True, notify_transient=True) is NotifyReason.ELSEWHERE
