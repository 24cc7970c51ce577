"""bench/crashloop.py writes a crash loop as systemd 252 journals it, read back by journalctl."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bench.crashloop import STARTING, LoopTiming, write_crash_loop
from vllm_supervisor.model import LifecycleEvent

pytestmark = pytest.mark.skipif(
    shutil.which("journalctl") is None or not Path("/lib/systemd/systemd-journal-remote").exists(),
    reason="needs journalctl and systemd-journal-remote",
)

UNIT = "vllm.service"
LINES = ["INFO starting engine", "RuntimeError: boom"]
# (what, MESSAGE_ID) of one invocation that is followed by a restart, in journal order.
ONE_RESTARTED = [
    ("starting", STARTING),
    ("started", LifecycleEvent.JOB_STARTED.value),
    ("line", None),
    ("line", None),
    ("exited", LifecycleEvent.PROCESS_EXITED.value),
    ("failed", LifecycleEvent.UNIT_FAILED.value),
    ("restart", LifecycleEvent.RESTART_SCHEDULED.value),
    ("stopped", LifecycleEvent.JOB_STOPPED.value),
]


def _read(directory: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["journalctl", f"--directory={directory}", "-o", "json", "--all", "--no-pager"],
        capture_output=True,
        check=True,
        text=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines()]


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    directory = tmp_path_factory.mktemp("loop") / "journal"
    written = write_crash_loop(directory, UNIT, LINES, name="test")
    entries = _read(directory)
    assert len(entries) == written.entries
    return entries, written.invocation_ids


class TestCrashLoopJournal:
    def test_order_of_messages(self, loop: tuple[list[dict[str, Any]], tuple[str, ...]]) -> None:
        """Five invocations, each start/started/lines/exited/failed, restart+stop between."""
        entries, _ = loop
        expected = ONE_RESTARTED * 4 + ONE_RESTARTED[:6]
        assert [e.get("MESSAGE_ID") for e in entries] == [mid for _, mid in expected]

    def test_pid1_fields(self, loop: tuple[list[dict[str, Any]], tuple[str, ...]]) -> None:
        """PID 1's messages come from init.scope as root and name the unit and its invocation."""
        entries, ids = loop
        pid1 = [e for e in entries if "MESSAGE_ID" in e]
        assert pid1
        for entry in pid1:
            sender = (entry["_PID"], entry["_UID"], entry["_SYSTEMD_UNIT"])
            assert sender == ("1", "0", "init.scope")
            assert entry["UNIT"] == UNIT
            assert entry["INVOCATION_ID"] in ids
        starts = [e for e in pid1 if e["MESSAGE_ID"] == STARTING]
        assert [e["INVOCATION_ID"] for e in starts] == list(ids)
        assert {e["JOB_TYPE"] for e in starts} == {"start"}
        exits = [e for e in pid1 if e["MESSAGE_ID"] == LifecycleEvent.PROCESS_EXITED.value]
        assert {(e["EXIT_CODE"], e["EXIT_STATUS"], e["COMMAND"]) for e in exits} == {
            ("exited", "1", "ExecStart")
        }
        restarts = [e for e in pid1 if e["MESSAGE_ID"] == LifecycleEvent.RESTART_SCHEDULED.value]
        assert [e["N_RESTARTS"] for e in restarts] == ["1", "2", "3", "4"]
        assert [e["INVOCATION_ID"] for e in restarts] == list(ids[:4])  # the ended invocation
        stops = [e for e in pid1 if e["MESSAGE_ID"] == LifecycleEvent.JOB_STOPPED.value]
        assert {(e["JOB_TYPE"], e["JOB_RESULT"]) for e in stops} == {("restart", "done")}

    def test_service_lines(self, loop: tuple[list[dict[str, Any]], tuple[str, ...]]) -> None:
        """The log's lines are the unit's stdout, one main PID per invocation."""
        entries, ids = loop
        lines = [e for e in entries if "MESSAGE_ID" not in e]
        assert [e["MESSAGE"] for e in lines] == LINES * 5
        assert {(e["_SYSTEMD_UNIT"], e["_TRANSPORT"], e["PRIORITY"]) for e in lines} == {
            (UNIT, "stdout", "6")
        }
        assert [e["_SYSTEMD_INVOCATION_ID"] for e in lines[::2]] == list(ids)
        assert len({e["_PID"] for e in lines}) == 5

    def test_timestamps(self, loop: tuple[list[dict[str, Any]], tuple[str, ...]]) -> None:
        """Each run spreads its lines over 60 s, exits, and restarts 10 s after failing."""
        entries, _ = loop
        times = [int(e["__REALTIME_TIMESTAMP"]) for e in entries]
        assert times == sorted(times)
        ids = [e.get("MESSAGE_ID") for e in entries]
        started = times[ids.index(LifecycleEvent.JOB_STARTED.value)]
        exited = times[ids.index(LifecycleEvent.PROCESS_EXITED.value)]
        failed = times[ids.index(LifecycleEvent.UNIT_FAILED.value)]
        restart = times[ids.index(LifecycleEvent.RESTART_SCHEDULED.value)]
        assert exited - started >= 60_000_000
        assert restart - failed == 10_000_000


class TestRecordedEnding:
    def test_killed_by_a_signal(self, tmp_path: Path) -> None:
        """A loop whose real journal shows a kill replays `code=killed` and result 'signal'."""
        write_crash_loop(
            tmp_path / "j", UNIT, LINES, name="killed", invocations=2, timing=LoopTiming(signal=9)
        )
        entries = _read(tmp_path / "j")
        exited = [e for e in entries if e.get("MESSAGE_ID") == LifecycleEvent.PROCESS_EXITED.value]
        failed = [e for e in entries if e.get("MESSAGE_ID") == LifecycleEvent.UNIT_FAILED.value]
        assert [(e["EXIT_CODE"], e["EXIT_STATUS"]) for e in exited] == [("killed", "9")] * 2
        assert "code=killed, status=9/KILL" in exited[0]["MESSAGE"]
        assert [e["UNIT_RESULT"] for e in failed] == ["signal", "signal"]

    def test_status_zero_has_no_exit_entry(self, tmp_path: Path) -> None:
        """systemd 252 logs only "Deactivated successfully" for a status-0 exit."""
        write_crash_loop(
            tmp_path / "j",
            UNIT,
            LINES,
            name="zero",
            invocations=2,
            timing=LoopTiming(exit_status=0),
        )
        ids = [e.get("MESSAGE_ID") for e in _read(tmp_path / "j")]
        assert LifecycleEvent.PROCESS_EXITED.value not in ids
        assert ids.count(LifecycleEvent.DEACTIVATED.value) == 2

    def test_other_status(self, tmp_path: Path) -> None:
        """An argparse exit replays as status 2."""
        write_crash_loop(
            tmp_path / "j", UNIT, LINES, name="two", invocations=1, timing=LoopTiming(exit_status=2)
        )
        exited = [
            e
            for e in _read(tmp_path / "j")
            if e.get("MESSAGE_ID") == LifecycleEvent.PROCESS_EXITED.value
        ]
        assert [e["EXIT_STATUS"] for e in exited] == ["2"]


def test_the_kernels_lines_are_the_kernels_own(tmp_path: Path) -> None:
    """A GPU's fault goes through journald's kernel transport, kern facility, shortly before
    each exit: `journalctl _TRANSPORT=kernel` finds them, the unit's own lines do not hold them."""
    directory = tmp_path / "journal"
    fault = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python3, GPU has fallen off the bus."
    written = write_crash_loop(
        directory, UNIT, [], name="kernel", invocations=2, kernel_lines=[fault]
    )
    entries = _read(directory)
    assert len(entries) == written.entries
    kernel = [e for e in entries if e.get("_TRANSPORT") == "kernel"]
    assert [e["MESSAGE"] for e in kernel] == [fault, fault]
    assert all(e["SYSLOG_FACILITY"] == "0" and "_SYSTEMD_UNIT" not in e for e in kernel)
    exits = [e for e in entries if e.get("MESSAGE_ID") == LifecycleEvent.PROCESS_EXITED.value]
    for line, ended in zip(kernel, exits, strict=True):
        gap = int(ended["__REALTIME_TIMESTAMP"]) - int(line["__REALTIME_TIMESTAMP"])
        assert 0 < gap <= 2_000_000
    times = [int(e["__REALTIME_TIMESTAMP"]) for e in entries]
    assert times == sorted(times)
