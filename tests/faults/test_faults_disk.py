"""Disk full under the state database, injected for real: a 2 MiB tmpfs as the state directory,
filled with a ballast file while the daemon runs, then emptied.

Needs root to mount. CI runs as root, so there the test fails loudly when mounting is
impossible; it skips only for a non-root developer.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_for
from slack_server import SECRET, SlackServer

from faults.conftest import SupervisorFactory
from faults.harness import (
    Supervisor,
    classified,
    crash,
    db_rows,
    history_cli,
    last_cursor,
    saved_cursor,
)
from vllm_supervisor.journal.writer import JournalWriter

QUARANTINE = Path("run") / "quarantine" / "vllm.service.json"
COMMIT_FAILED = 'vllm_supervisor_state_errors_total{reason="commit_failed"}'


@pytest.fixture(name="small_state")
def _small_state(tmp_path: Path) -> Iterator[Path]:
    """tmp_path/state as a 2 MiB tmpfs of its own, unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root and never skips this)")
    state = tmp_path / "state"
    state.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0750", "vsup-test-state", str(state)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    try:
        yield state
    finally:
        subprocess.run(["umount", str(state)], check=True, capture_output=True, timeout=30)


def _fill(directory: Path) -> Path:
    """Write a ballast file until the filesystem is full; return it."""
    ballast = directory / "ballast"
    chunk = b"\0" * 65536
    with ballast.open("wb", buffering=0) as handle:
        try:
            while True:
                handle.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        with contextlib.suppress(OSError):
            while True:
                handle.write(b"\0" * 512)  # the last partial chunk
    return ballast


def _events(sup: Supervisor, name: str) -> list[dict[str, Any]]:
    return [e for e in sup.events() if e.get("event") == name]


def _http(sup: Supervisor, path: str) -> tuple[int, str]:
    """GET the child's metrics endpoint (its port is in the metrics_listening event)."""
    port = _events(sup, "metrics_listening")[-1]["port"]
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _metric(sup: Supervisor, sample: str) -> float:
    for line in _http(sup, "/metrics")[1].splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def _texts(slack: SlackServer) -> list[str]:
    return [r.json()["text"] for r in slack.requests]


class TestDiskFull:
    """The state database's filesystem fills up under the running daemon, then frees."""

    def test_keeps_classifying_and_alerting_then_commits_once_space_returns(
        self,
        small_state: Path,
        tmp_path: Path,
        slack: SlackServer,
        make_supervisor: SupervisorFactory,
    ) -> None:
        """While full: crashes are classified, the fatal one halted, both announced (from
        memory), the fault logged once, counted, and /healthz is 503. Once space returns the
        held batch commits on its own (no new entry needed): history complete, every message
        recorded as sent, none sent twice, and the cursor at the journal's end."""
        sup = make_supervisor(slack_url=slack.url, state="commit_retry_max_s = 0.5\n")
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(crash("unknown", 1))
            sup.start()
            wait_for(lambda: len(slack.requests) == 1, what="the first crash announced")
            wait_for(lambda: db_rows(small_state, "SELECT notified FROM history") == [(1,)])
            ballast = _fill(small_state)

            writer.write(crash("fatal", 2))
            writer.nudge()
            wait_for(lambda: (tmp_path / QUARANTINE).exists(), what="the halt while full")
            wait_for(lambda: len(slack.requests) == 2, what="an alert while the disk is full")
            writer.write(crash("unknown", 3))
            writer.nudge()
            wait_for(lambda: len(slack.requests) == 3, what="a second alert while full")
            wait_for(lambda: _metric(sup, COMMIT_FAILED) >= 2, what="failed commits counted")
            assert len(classified(small_state)) == 1  # nothing reached the database
            status, body = _http(sup, "/healthz")
            assert status == 503
            assert any("not writable" in r for r in json.loads(body)["reasons"]), body
            failures = _events(sup, "state_commit_failed")
            assert len(failures) == 1, "a repeated commit failure must be logged once"
            assert "full" in failures[0]["error"]

            ballast.unlink()
            wait_for(lambda: len(classified(small_state)) == 3, what="the held batch committed")
            wait_for(lambda: _http(sup, "/healthz")[0] == 200, what="healthy again")
            assert _events(sup, "state_commit_recovered")
        assert sup.terminate() == 0, sup.stderr_text()
        history = history_cli(small_state)
        assert [h["invocation_id"] for h in history] == [f"{n:032x}" for n in (1, 2, 3)]
        assert all(h["notified"] for h in history)
        assert db_rows(small_state, "SELECT state FROM outbox ORDER BY id") == [("sent",)] * 3
        texts = _texts(slack)
        assert len(texts) == 3
        assert len(set(texts)) == 3, "a message went out twice"
        assert "0.6.2" in texts[1]
        assert saved_cursor(small_state) == last_cursor(tmp_path / "journal")
        assert SECRET not in "".join(p.read_text(errors="replace") for p in sup.logs)

    def test_a_restart_while_full_sends_no_message_twice(
        self,
        small_state: Path,
        tmp_path: Path,
        slack: SlackServer,
        make_supervisor: SupervisorFactory,
    ) -> None:
        """Seen before: restarted while the state disk was full, the daemon read the batch it
        could not commit again and posted its crashes a second time. What was told from memory
        is remembered in the runtime directory (another file system, kept across restarts):
        the next daemon records it as told, and the history is complete once space returns."""
        sup = make_supervisor(slack_url=slack.url, state="commit_retry_max_s = 0.5\n")
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(crash("unknown", 1))
            sup.start()
            wait_for(lambda: db_rows(small_state, "SELECT notified FROM history") == [(1,)])
            ballast = _fill(small_state)
            writer.write(crash("fatal", 2))
            writer.write(crash("unknown", 3))
            writer.nudge()
            wait_for(lambda: len(slack.requests) == 3, what="both told from memory while full")
            assert sup.terminate() == 0, sup.stderr_text()

            again = make_supervisor(slack_url=slack.url, state="commit_retry_max_s = 0.5\n")
            again.start()
            wait_for(lambda: _events(again, "state_commit_failed"), what="the batch read again")
            ballast.unlink()
            wait_for(lambda: len(classified(small_state)) == 3, what="the batch committed")
            wait_for(lambda: all(h["notified"] for h in history_cli(small_state)),
                     what="every crash recorded as told")  # fmt: skip
        assert again.terminate() == 0, again.stderr_text()
        texts = _texts(slack)
        assert len(texts) == 3, texts
        assert len(set(texts)) == 3, "a message went out twice"
        assert db_rows(small_state, "SELECT state FROM outbox ORDER BY id") == [("sent",)] * 3
