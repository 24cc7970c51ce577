"""Faults that end a process: kill -9 of the supervisor, SIGTERM in a burst, the reader killed."""

from __future__ import annotations

import os
import random
import signal
import threading
from collections import Counter
from pathlib import Path

import pytest
from conftest import wait_for
from slack_server import SlackServer

from faults.conftest import SupervisorFactory
from faults.harness import (
    children,
    classified,
    crash,
    db_rows,
    history_cli,
    is_follower,
    last_cursor,
    saved_cursor,
)
from vllm_supervisor.journal.writer import JournalWriter

KINDS = ("fatal", "transient", "unknown", "unknown", "transient")
SLACK_EXTRA = "group_interval_s = 0.2\n"
# A reply slower than the client's timeout is retried, and may then be posted twice by design
# (test_faults_slack.py); on a loaded machine 2 s is not always enough. These tests are about
# kills, so their only allowed repeats are the messages in flight at a kill.
SLACK_TIMEOUT_S = 30.0


def _kinds(count: int, rng: random.Random) -> list[str]:
    return [rng.choice(KINDS) for _ in range(count)]


class _Streamer(threading.Thread):
    """Writes crash invocations into the journal at a steady pace until all are written."""

    def __init__(self, writer: JournalWriter, kinds: list[str], pause_s: float) -> None:
        super().__init__(daemon=True)
        self.writer, self.kinds, self.pause_s = writer, kinds, pause_s
        self.written = 0
        self.halt = threading.Event()

    def run(self) -> None:
        for serial, kind in enumerate(self.kinds, 1):
            if self.halt.is_set():
                return
            self.writer.write(crash(kind, serial))
            self.writer.nudge()
            self.written = serial
            self.halt.wait(self.pause_s)  # the traffic's pace, not a synchronisation


def _assert_exactly_once(
    state_dir: Path,
    journal: Path,
    slack: SlackServer,
    ids: list[str],
    in_flight: frozenset[int] = frozenset(),
) -> None:
    """History holds each crash once, Slack got each message once, the cursor is at the end.

    `in_flight` are indexes of Slack requests that were the last a killed supervisor sent: a
    SIGKILL between Slack's 200 and the commit that marks the message sent repeats that one
    message (at-least-once at the wire: a webhook has no idempotency key), and nothing else.
    """
    history = history_cli(state_dir)
    got = Counter(item["invocation_id"] for item in history)
    assert sorted(got) == sorted(ids), "a crash is missing from history"
    assert set(got.values()) == {1}, f"duplicates in history: {got.most_common(3)}"
    assert all(item["notified"] for item in history), "a crash was never announced"
    # A message sent again after a kill mid-send says so ("(repeat) " before its text).
    texts = [r.json()["text"].removeprefix("(repeat) ") for r in slack.requests]
    repeats = [i for i, text in enumerate(texts) if text in texts[:i]]
    for index in repeats:
        assert slack.requests[index].json()["text"].startswith("(repeat) "), texts[index]
    for index in repeats:
        first = texts.index(texts[index])
        assert first in in_flight, f"a message not in flight at a kill went out twice: {first}"
    assert len(repeats) <= len(in_flight)
    sent = db_rows(state_dir, "SELECT count(*) FROM outbox WHERE state = 'sent'")[0][0]
    pending = db_rows(state_dir, "SELECT count(*) FROM outbox WHERE state != 'sent'")[0][0]
    assert (sent, pending) == (len(slack.requests) - len(repeats), 0)
    assert saved_cursor(state_dir) == last_cursor(journal)


def _all_delivered(state_dir: Path, ids: list[str]) -> bool:
    rows = db_rows(state_dir, "SELECT count(*) FROM history WHERE notified = 1")
    return bool(rows) and rows[0][0] == len(ids)


class TestKillNine:
    """SIGKILL of the supervisor while crashes stream into the journal."""

    def test_kill_nine_at_random_points_loses_and_repeats_nothing(
        self, tmp_path: Path, slack: SlackServer, make_supervisor: SupervisorFactory
    ) -> None:
        """Four SIGKILLs at seeded random points: every crash once in history and in Slack."""
        rng = random.Random(20240607)
        kinds = _kinds(24, rng)
        ids = [f"{n:032x}" for n in range(1, len(kinds) + 1)]
        kill_at = sorted(rng.sample(range(2, len(kinds) - 2), 4))
        sup = make_supervisor(
            slack_url=slack.url, extra=SLACK_EXTRA, slack_timeout_s=SLACK_TIMEOUT_S
        )
        state = tmp_path / "state"
        in_flight: set[int] = set()
        with JournalWriter(tmp_path / "journal") as writer:
            streamer = _Streamer(writer, kinds, pause_s=0.15)
            sup.start()
            streamer.start()
            for threshold in kill_at:
                wait_for(
                    lambda t=threshold: len(classified(state)) >= t, what=f"{threshold} crashes"
                )
                # A random extra delay puts the kill anywhere in a batch, a commit or a send.
                deadline = rng.uniform(0, 0.2)
                threading.Event().wait(deadline)
                sup.kill9()
                # What the killed run had sent is in the server's socket: let it be recorded.
                wait_for(slack.idle, what="the Slack server to finish its requests")
                in_flight.add(slack.count() - 1)
                sup.start()
            streamer.join(timeout=30)
            assert streamer.written == len(kinds)

            def done() -> bool:
                writer.nudge()
                return len(classified(state)) == len(kinds) and _all_delivered(state, ids)

            wait_for(done, timeout=30, what="every crash classified and announced")
            # The last run may have found nothing left to do: a SIGTERM before its handlers are
            # set would end it with -15, which is not the behaviour under test.
            wait_for(sup.following, what="the last run following the journal")
        assert sup.terminate() == 0, sup.stderr_text()
        assert len(sup.logs) == 5
        _assert_exactly_once(state, tmp_path / "journal", slack, ids, frozenset(in_flight))
        print(
            f"kills at {kill_at} crashes; wire repeats of in-flight messages allowed: {in_flight}"
        )


class TestSigterm:
    """SIGTERM in the middle of a burst of entries."""

    def test_sigterm_during_a_burst_exits_promptly_and_resumes_exactly(
        self, tmp_path: Path, slack: SlackServer, make_supervisor: SupervisorFactory
    ) -> None:
        """Exit 0 within 10 s; the restarted supervisor neither repeats nor misses a crash."""
        kinds = _kinds(200, random.Random(7))
        ids = [f"{n:032x}" for n in range(1, len(kinds) + 1)]
        sup = make_supervisor(
            slack_url=slack.url, extra=SLACK_EXTRA, slack_timeout_s=SLACK_TIMEOUT_S
        )
        state = tmp_path / "state"
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(crash(kinds[0], 1))
            sup.start()
            wait_for(lambda: len(classified(state)) == 1, what="the first crash")
            for serial, kind in enumerate(kinds[1:], 2):
                writer.write(crash(kind, serial), flush=False)
            writer.write([])
            writer.nudge()
            wait_for(lambda: len(classified(state)) >= 3, what="the burst to be under way")
            assert sup.terminate(timeout=10) == 0, sup.stderr_text()
            stopped_at = len(classified(state))
            print(f"SIGTERM after {stopped_at} of {len(kinds)} crashes")
            sup.start()

            def done() -> bool:
                writer.nudge()
                return len(classified(state)) == len(kinds) and _all_delivered(state, ids)

            wait_for(done, timeout=30, what="every crash classified and announced")
        assert sup.terminate(timeout=10) == 0, sup.stderr_text()
        _assert_exactly_once(state, tmp_path / "journal", slack, ids)
        assert stopped_at >= 3


class TestReaderKilled:
    """The reader child (journalctl or the native reader) dies under the running daemon."""

    @pytest.mark.parametrize("reader", ["journalctl", "native"])
    def test_killed_reader_is_restarted_and_nothing_is_lost(
        self, tmp_path: Path, make_supervisor: SupervisorFactory, reader: str
    ) -> None:
        """Three SIGKILLs of the reader child: it comes back with backoff; history is complete."""
        sup = make_supervisor(reader=reader)
        state = tmp_path / "state"
        serial = 1
        with JournalWriter(tmp_path / "journal") as writer:
            # An empty journal makes journalctl exit at once ("boot +0 not available").
            writer.write(crash("unknown", serial))
            sup.start()
            wait_for(lambda: len(classified(state)) == 1, what="the first crash")
            for _round in range(3):
                wait_for(
                    lambda: any(is_follower(p) for p in children(sup.pid)),
                    what=f"a {reader} reader child",
                )
                child = next(p for p in children(sup.pid) if is_follower(p))
                for _ in range(3):
                    serial += 1
                    writer.write(crash("unknown", serial))
                writer.nudge()
                wait_for(lambda s=serial: len(classified(state)) >= s, what=f"{serial} crashes")
                os.kill(child, signal.SIGKILL)
                # Crashes written while no reader runs must still be found.
                for _ in range(2):
                    serial += 1
                    writer.write(crash("unknown", serial))
                writer.nudge()
                wait_for(lambda c=child: c not in children(sup.pid), what="the child reaped")

            def done() -> bool:
                writer.nudge()
                return len(classified(state)) == serial

            wait_for(done, what="every crash classified")
        assert sup.terminate() == 0, sup.stderr_text()
        history = history_cli(state)
        assert [h["invocation_id"] for h in history] == [f"{n:032x}" for n in range(1, serial + 1)]
        restarts = [e for e in sup.events() if e["event"] == "journal_reader_restarting"]
        assert len(restarts) >= 3
        assert saved_cursor(state) == last_cursor(tmp_path / "journal")
