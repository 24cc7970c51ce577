"""Faults of the saved state: a corrupt database file, a cursor the journal refuses."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
from conftest import wait_for

from faults.conftest import SupervisorFactory
from faults.harness import classified, crash, history_cli
from vllm_supervisor.journal.writer import JournalWriter


def wait_until(condition: object, seconds: float) -> bool:
    """Poll `condition` for at most `seconds`; report whether it came true."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def _events(sup: object, name: str) -> list[dict[str, object]]:
    return [e for e in sup.events() if e["event"] == name]  # type: ignore[attr-defined]


class TestCorruptDatabase:
    """Garbage bytes where the state database should be."""

    def test_corrupt_database_is_moved_aside_and_the_daemon_starts_afresh(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """One error line, the file kept as state.sqlite3.corrupt-<time>, crashes classified."""
        state = tmp_path / "state"
        state.mkdir()
        (state / "state.sqlite3").write_bytes(b"\x00garbage\xff" * 4096)
        sup = make_supervisor()
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(crash("fatal", 1))
            sup.start()
            wait_for(lambda: classified(state) == [f"{1:032x}"], what="the crash classified")
            assert sup.alive()
            assert sup.terminate() == 0
            # A second start finds a sound database: no loop of moving files aside.
            writer.write(crash("unknown", 2))
            sup.start()
            wait_for(lambda: len(classified(state)) == 2, what="the second crash")
        assert sup.terminate() == 0
        corrupt = _events(sup, "state_database_corrupt")
        assert len(corrupt) == 1
        assert corrupt[0]["level"] == "error"
        aside = list(state.glob("state.sqlite3.corrupt-*"))
        assert [str(p) for p in aside] == [corrupt[0]["moved_to"]]
        assert aside[0].read_bytes().startswith(b"\x00garbage")
        assert "Traceback" not in sup.stderr_text()


class TestBadCursor:
    """A saved cursor journalctl refuses (another journal's, or damaged)."""

    @pytest.mark.parametrize("resume", ["head", "tail"])
    def test_refused_cursor_warns_and_resumes_where_configured(
        self, tmp_path: Path, make_supervisor: SupervisorFactory, resume: str
    ) -> None:
        """A warning; head re-reads all once, tail skips the backlog and sees new crashes."""
        state = tmp_path / "state"
        sup = make_supervisor(state=f'on_bad_cursor = "{resume}"\n')
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(crash("unknown", 1))
            sup.start()
            wait_for(lambda: len(classified(state)) == 1, what="the first crash")
            assert sup.terminate() == 0
            with sqlite3.connect(state / "state.sqlite3") as db:
                db.execute("UPDATE meta SET value = 'not-a-cursor' WHERE key = 'cursor'")
            writer.write(crash("unknown", 2))  # while the supervisor is down
            sup.start()
            wait_for(lambda: _events(sup, "journal_cursor_rejected"), what="the rejection")

            if resume == "head":
                expected = [1, 2]
            else:
                # "tail" starts after whatever the journal holds when journalctl seeks, so keep
                # adding crashes until one is seen; every one after it must be seen too.
                serial = 2
                deadline = time.monotonic() + 20

                def seen() -> bool:
                    writer.nudge()
                    return len(classified(state)) > 1

                while not seen() and time.monotonic() < deadline:
                    serial += 1
                    writer.write(crash("unknown", serial))
                    wait_until(seen, 0.5)
                first = int(classified(state)[1], 16)
                writer.write(crash("unknown", serial + 1))
                expected = [1, *range(first, serial + 2)]

            def done() -> bool:
                writer.nudge()
                return classified(state) == [f"{n:032x}" for n in expected]

            wait_for(done, what=f"crashes {expected} in history")
        assert sup.terminate() == 0
        assert [h["invocation_id"] for h in history_cli(state)] == [f"{n:032x}" for n in expected]
        assert _events(sup, "journal_cursor_rejected")[0]["resume_at"] == resume
