"""Decisions an operator can trust, on real journal files and a real `vllm-supervisor run`.

Each test is a situation seen on a real systemd 252 or real vLLM runs, replayed into a journal
written by systemd-journal-remote (with journald's trusted fields: this machine, this boot),
and read by the daemon as it runs in production (a child process, systemd control off: only
the quarantine record and what history and Slack say can be checked here; tests/e2e has the
same under a real systemd). Each one failed on the code before the trust work; the docstrings
say how.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

from conftest import wait_for
from faults.conftest import SupervisorFactory
from faults.harness import Supervisor, classified, crash, db_rows, history_cli
from slack_server import SlackServer

from trust.journal import (
    REQUEST_ERROR,
    UNIT,
    Entry,
    ago,
    at,
    fatal_crash,
    lines,
    oom_killed,
    serving,
    skipped_by_the_gate,
    stopped_by_a_person,
    suppressed,
)
from vllm_supervisor.journal.writer import EntryFactory, JournalWriter, exit_entries, lifecycle
from vllm_supervisor.model import LifecycleEvent

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "journals"
QUARANTINE = Path("run") / "quarantine" / f"{UNIT}.json"


def writer_from(journal: Path, seconds_ago: float) -> JournalWriter:
    """A journal whose clock starts `seconds_ago` (journald's clock never goes back)."""
    return JournalWriter(journal, factory=EntryFactory(clock_us=ago(seconds_ago)))


def history_of(state: Path, count: int) -> list[dict[str, Any]]:
    """The history once it holds `count` invocations (its CLI, as an operator reads it)."""
    wait_for(lambda: len(classified(state)) >= count, what=f"{count} invocations decided")
    return history_cli(state)


def events(sup: Supervisor, name: str) -> list[dict[str, Any]]:
    """The daemon's log events of one kind."""
    return [e for e in sup.events() if e.get("event") == name]


def errors(sup: Supervisor) -> list[dict[str, Any]]:
    """Every error-level event, and any traceback, of the daemon's runs."""
    assert "Traceback" not in sup.stderr_text(), sup.stderr_text()
    return [e for e in sup.events() if e.get("level") == "error"]


def pending_messages(state: Path) -> int:
    """Slack messages queued and not yet sent."""
    rows = db_rows(state, "SELECT count(*) FROM outbox WHERE state = 'pending'")
    return int(rows[0][0]) if rows else 0


class TestNeverDies:
    def test_a_manual_start_a_minute_after_a_failure(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """start_at=head on a failed invocation and a manual start 60 s later: both are read
        and the daemon goes on (it died of KeyError in InvocationTracker._close, and again at
        every restart). The old crash is history; a crash of the running invocation now is not."""
        sup = make_supervisor()
        state = tmp_path / "state"
        with writer_from(tmp_path / "journal", 150) as writer:
            writer.write(fatal_crash(UNIT, "a" * 32, pid=100, restarts=None))
            writer.write(at(serving(UNIT, "b" * 32, pid=200), ago(90)))
            sup.start()
            [old] = history_of(state, 1)
            assert (old["taken"], old["decision"]["rule"]) == ("recorded", "late")
            assert old["verdict"]["signature"] == "flashinfer_cubin_mismatch"
            assert not (tmp_path / QUARANTINE).exists()
            writer.write(
                at(lines(UNIT, "b" * 32, ["RuntimeError: CUDA error: no kernel"], 200), ago(0))
            )
            writer.write(exit_entries(UNIT, "b" * 32, 1))
            writer.nudge()
            now = history_of(state, 2)[1]
            assert sup.alive()
        assert now["invocation_id"] == "b" * 32
        assert now["taken"] != "recorded"  # the present crash is acted on
        assert sup.terminate() == 0
        assert errors(sup) == []

    def test_a_real_port_in_use_loop_with_a_stop_and_a_start(self) -> None:
        """`triage` of a real journal (systemd 252 in nspawn, `journalctl -o export`): a
        port-in-use crash loop, `systemctl stop` while it waited to restart, `systemctl start`
        1.5 s later. It raised KeyError; now every invocation is reported once."""
        result = subprocess.run(
            [sys.executable, "-m", "vllm_supervisor", "triage", "--format", "json",
             str(DATA / "port-in-use-stop-start.export")],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        reported = json.loads(result.stdout)["invocations"]
        ids = [i["invocation_id"] for i in reported]
        assert len(ids) == len(set(ids)) >= 19
        assert {i["verdict"]["signature"] for i in reported} == {"port_in_use"}

    def test_two_hosts_in_one_directory(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """A journal directory holding two hosts (journal-remote): their entries interleave
        under one unit name. Another host's fatal crash is reported with its host name and
        never quarantines this host's unit, which keeps serving."""
        sup = make_supervisor()
        state = tmp_path / "state"
        other = {"_MACHINE_ID": "f" * 32, "_HOSTNAME": "gpu-other"}
        theirs = [{**e, **other} for e in fatal_crash(UNIT, "c" * 32, pid=300)]
        ours = serving(UNIT, "d" * 32, pid=400)
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write([entry for pair in zip(theirs, ours * 4, strict=False) for entry in pair])
            writer.write(theirs[len(ours) * 4 :])
            sup.start()
            [crashed] = history_of(state, 1)
        assert crashed["host"] == "gpu-other"
        assert crashed["taken"] == "recorded"
        assert crashed["decision"]["rule"] == "other_host"
        assert not (tmp_path / QUARANTINE).exists()
        assert sup.terminate() == 0
        assert errors(sup) == []


class TestActsOnlyOnThePresent:
    def test_a_thirty_day_old_crash_is_history(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """A fatal crash 30 days old, read from the journal's head: recorded and reported,
        never quarantined (it was halted like a live one)."""
        sup = make_supervisor()
        with writer_from(tmp_path / "journal", 30 * 86400) as writer:
            writer.write(fatal_crash(UNIT, "e" * 32, pid=500))
            sup.start()
            [old] = history_of(tmp_path / "state", 1)
        assert (old["decision"]["action"], old["taken"]) == ("observe", "recorded")
        assert "read late" in old["decision"]["reason"]
        assert not (tmp_path / QUARANTINE).exists()
        assert sup.terminate() == 0

    def test_a_crash_loop_read_late_is_one_slack_message(
        self, tmp_path: Path, make_supervisor: SupervisorFactory, slack: SlackServer
    ) -> None:
        """30 crashes while the supervisor was down, then the repaired unit serving: one
        summary message, nothing quarantined (there were 29 halts and 29 messages)."""
        sup = make_supervisor(slack_url=slack.url, extra="backlog_hold_s = 1.0\n")
        state = tmp_path / "state"
        with writer_from(tmp_path / "journal", 3600) as writer:
            for n in range(30):
                writer.write(fatal_crash(UNIT, f"{n:032x}", pid=1000 + n, restarts=n + 1))
            writer.write(at(serving(UNIT, "f" * 32, pid=2000), ago(60)))
            sup.start()
            seen = history_of(state, 30)
            wait_for(lambda: slack.count() >= 1 and pending_messages(state) == 0, what="summary")
        assert {i["taken"] for i in seen} == {"recorded"}
        assert not (tmp_path / QUARANTINE).exists()
        assert slack.count() == 1
        text = slack.requests[0].json()["text"]
        assert "30 past crashes read late" in text
        assert "recorded only, no action taken" in json.dumps(slack.requests[0].json())
        assert sup.terminate() == 0

    def test_an_invocation_of_the_previous_boot_ended_with_the_boot(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """A power loss: the previous boot's invocation never ended and holds one request
        traceback. It ended with the boot, it is no crash (it was halted and quarantined right
        after the new boot started serving)."""
        sup = make_supervisor()
        earlier = {"_BOOT_ID": "0" * 31 + "1"}
        with writer_from(tmp_path / "journal", 7200) as writer:
            before = serving(UNIT, "1" * 32, pid=600) + lines(UNIT, "1" * 32, REQUEST_ERROR, 600)
            writer.write([{**e, **earlier} for e in before])
            writer.write(at(serving(UNIT, "2" * 32, pid=700), ago(30)))
            sup.start()
            [gone] = history_of(tmp_path / "state", 1)
        assert gone["invocation_id"] == "1" * 32
        assert gone["ending"] == "boot"
        assert gone["decision"]["action"] == "observe"
        assert not (tmp_path / QUARANTINE).exists()
        assert sup.terminate() == 0


class TestTheCauseBelongsToTheCrash:
    def test_a_bad_request_hours_before_a_clean_stop(
        self, tmp_path: Path, make_supervisor: SupervisorFactory, slack: SlackServer
    ) -> None:
        """One bad request while serving (uvicorn's `Exception in ASGI application`, a
        ValueError that matches vllm_config_invalid), then a person's clean `systemctl stop`
        hours later: observed, not a crash, no message (it was halted as an invalid config)."""
        sup = make_supervisor(slack_url=slack.url)
        state = tmp_path / "state"
        inv = "3" * 32
        with writer_from(tmp_path / "journal", 3 * 3600) as writer:
            writer.write(serving(UNIT, inv, pid=800) + lines(UNIT, inv, REQUEST_ERROR, 800))
            writer.write(at(stopped_by_a_person(UNIT, inv, 800, status=0), ago(5)))
            sup.start()
            [stopped] = history_of(state, 1)
            wait_for(lambda: pending_messages(state) == 0, what="the outbox idle")
        assert stopped["decision"]["rule"] == "operator_stop"
        assert not (tmp_path / QUARANTINE).exists()
        assert slack.count() == 0
        assert sup.terminate() == 0

    def test_an_oom_kill_a_day_after_a_bad_request(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """A worker OOM-killed 30 h after one bad request is reported as the OOM kill, not as
        the request's invalid config, and is not halted on it."""
        sup = make_supervisor()
        inv = "4" * 32
        with writer_from(tmp_path / "journal", 30 * 3600) as writer:
            writer.write(serving(UNIT, inv, pid=900) + lines(UNIT, inv, REQUEST_ERROR, 900))
            writer.write(at(oom_killed(UNIT, inv), ago(1)))
            sup.start()
            [killed] = history_of(tmp_path / "state", 1)
        verdict = killed["verdict"]
        assert verdict["signature"] != "vllm_config_invalid"
        assert "OOM killer" in verdict["root_cause"]
        assert any("Exception in ASGI" in n or "ValueError" in n for n in verdict["notes"])
        assert killed["decision"]["action"] != "halt"
        assert not (tmp_path / QUARANTINE).exists()
        assert sup.terminate() == 0

    def test_a_long_run_keeps_the_traceback_at_its_end(self, tmp_path: Path) -> None:
        """200k lines and 150 request tracebacks over hours, then a fatal error on one rank and
        the other ranks' NCCL watchdog timeouts: the error cap kept the first 2000 error lines,
        so the verdict was nccl_timeout (transient) and nothing said lines were dropped."""
        journal, inv, start = tmp_path / "journal", "5" * 32, ago(4 * 3600)
        entries: list[Entry] = at(serving(UNIT, inv, pid=10), start)
        for n in range(150):
            batch = lines(UNIT, inv, REQUEST_ERROR, 10)
            entries += at(batch, start + (n + 1) * 60_000_000)
            entries += lines(UNIT, inv, [f"INFO request {n}.{k} ok" for k in range(1300)], 10)
        entries += at(lines(UNIT, inv, ["INFO still serving"], 10), ago(30))
        entries += lines(UNIT, inv, [f"(Worker_TP3 pid=13) {t}" for t in _fatal_texts()], 13)
        for rank in (0, 1, 2, 4, 5, 6, 7):
            entries += lines(UNIT, inv, [_nccl_timeout(rank)], 20 + rank)
        entries += exit_entries(UNIT, inv, 1)
        with JournalWriter(journal) as writer:
            writer.write(entries)
        result = subprocess.run(
            [sys.executable, "-m", "vllm_supervisor", "triage", "--format", "json", str(journal)],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        [crashed] = json.loads(result.stdout)["invocations"]
        assert crashed["lines"] > 195_000
        verdict = crashed["verdict"]
        assert verdict["signature"] == "flashinfer_cubin_mismatch"
        assert verdict["severity"] == "fatal"
        assert crashed["decision"]["action"] == "halt", crashed
        assert crashed["dropped_lines"] > 190_000
        assert any("dropped by the memory caps" in n for n in verdict["notes"])


def _fatal_texts() -> list[str]:
    return [
        "ERROR 11-30 10:01:09 [multiproc_executor.py:1] WorkerProc hit an exception.",
        "Traceback (most recent call last):",
        '  File "/opt/venv/lib/python3.12/site-packages/flashinfer/jit/env.py", line 76, in '
        "_get_cubin_dir",
        "    raise RuntimeError(",
        "RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version "
        "(0.6.4). Please install the same version of both packages.",
    ]


def _nccl_timeout(rank: int) -> str:
    return (
        f"(Worker_TP{rank} pid={20 + rank}) [rank{rank}]:[E1130 10:11:03.123456 5301 "
        f"ProcessGroupNCCL.cpp:632] [Rank {rank}] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=52311, OpType=ALLREDUCE, NumelIn=4194304, NumelOut=4194304, "
        "Timeout(ms)=600000) ran for 600081 milliseconds before timing out."
    )


class TestAPersonsStopIsNoCrash:
    def test_a_server_that_exits_143_stopped_three_times(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """A server that traps SIGTERM and exits 143, stopped and started by a person three
        times: three operator stops (each counted as the same unknown crash; the third was
        halted)."""
        sup = make_supervisor()
        with JournalWriter(tmp_path / "journal") as writer:
            for n in range(3):
                inv = f"{n + 6:032x}"
                writer.write(serving(UNIT, inv, pid=1100 + n))
                writer.write(stopped_by_a_person(UNIT, inv, 1100 + n, status=143))
            sup.start()
            seen = history_of(tmp_path / "state", 3)
        assert [i["exit_status"] for i in seen] == [143] * 3
        assert [i["decision"]["rule"] for i in seen] == ["operator_stop"] * 3
        assert not (tmp_path / QUARANTINE).exists()
        assert sup.terminate() == 0

    def test_a_skipped_start_is_no_crash_and_no_message(
        self, tmp_path: Path, make_supervisor: SupervisorFactory, slack: SlackServer
    ) -> None:
        """After a halt, each start the gate refuses logs the gate's line (which quotes the
        crash): one message for the crash, none for the skip (each skip was another message
        titled with the original crash)."""
        sup = make_supervisor(slack_url=slack.url)
        state = tmp_path / "state"
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(fatal_crash(UNIT, "7" * 32, pid=1200, restarts=1))
            writer.write(skipped_by_the_gate(UNIT, "8" * 32, pid=1201))
            sup.start()
            crashed, skipped = history_of(state, 2)
            wait_for(lambda: slack.count() == 1 and pending_messages(state) == 0, what="sent")
        assert crashed["decision"]["action"] == "halt", crashed
        assert (skipped["ending"], skipped["decision"]["rule"]) == ("skipped", "skipped")
        assert skipped["verdict"]["signature"] is None
        members = db_rows(state, "SELECT invocation_id FROM outbox_member")
        assert members == [("7" * 32,)]
        assert sup.terminate() == 0


class TestLostLinesAreSaid:
    def test_a_crash_whose_lines_journald_dropped(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """journald's rate limit can drop every line of a crash, and says so only later, with
        the next invocation's first line: the crash says its lines were lost (it said "No crash
        found"), and the later notice is added to its history and counted."""
        sup = make_supervisor()
        state = tmp_path / "state"
        silent, after = "9" * 32, "a1" * 16
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(
                [
                    lifecycle(UNIT, silent, LifecycleEvent.STARTING, f"Starting {UNIT}...",
                              JOB_TYPE="start"),
                    *exit_entries(UNIT, silent, 1),
                ]
            )  # fmt: skip
            sup.start()
            [lost] = history_of(state, 1)
            assert lost["verdict"]["title"] == "Crash whose log lines were lost"
            assert "Main process exited" in lost["verdict"]["root_cause"]
            writer.write(at(serving(UNIT, after, pid=1300), ago(0)))
            writer.write([suppressed(UNIT, 177528, after)])
            writer.nudge()
            wait_for(lambda: events(sup, "journal_lines_suppressed"), what="the late notice")
            noted = history_cli(state)[0]["verdict"]["notes"]
        assert any("journald dropped 177528 lines" in n for n in noted)
        assert sup.terminate() == 0


class TestHonestState:
    def test_release_clears_the_halted_gauge_at_once(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """`release` removes the record and the daemon's unit_halted drops to 0 at the next
        scrape (it stayed 1 until the daemon restarted, and the critical alert kept firing).
        With systemd control off the halt is a quarantine, not counted as a stop."""
        sup = make_supervisor()
        with JournalWriter(tmp_path / "journal") as writer:
            writer.write(crash("fatal", 1))
            sup.start()
            [halted] = history_of(tmp_path / "state", 1)
            assert halted["taken"] == "quarantined"
            wait_for(lambda: _metric(sup, HALTED) == 1.0, what="unit_halted 1")
            assert _metric(sup, HALTS) == 0.0
            subprocess.run(
                [sys.executable, "-m", "vllm_supervisor", "release", UNIT,
                 "--config", str(sup.config)],
                check=True, capture_output=True, timeout=30,
            )  # fmt: skip
            assert _metric(sup, HALTED) == 0.0
            wait_for(lambda: events(sup, "unit_released"), what="the daemon told of it")
        assert sup.terminate() == 0

    def test_a_second_daemon_on_the_same_state_refuses(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """Two daemons on one state directory both ran (7 duplicate Slack messages): the second
        now exits 2 with one line naming the first."""
        first = make_supervisor()
        (tmp_path / "journal").mkdir()
        first.start()
        wait_for(first.following, what="the first daemon following")
        second = subprocess.run(
            [sys.executable, "-m", "vllm_supervisor", "run", "--config", str(first.config)],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert second.returncode == 2
        [line] = [x for x in second.stderr.splitlines() if not x.startswith("{")]
        assert f"another vllm-supervisor (pid {first.pid})" in line
        assert first.alive()
        assert first.terminate() == 0

    def test_a_template_unit_is_rejected_with_how_to_list_its_instances(
        self, tmp_path: Path
    ) -> None:
        """`vllm@.service` was accepted and supervised nothing, silently."""
        config = tmp_path / "supervisor.toml"
        config.write_text('[[unit]]\nname = "vllm@.service"\n', encoding="utf-8")
        result = subprocess.run(
            [sys.executable, "-m", "vllm_supervisor", "check-config", str(config)],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1
        assert "unit[0].name: 'vllm@.service' is a template" in result.stderr
        assert "vllm@0.service" in result.stderr

    def test_sighup_reloads_the_units_and_names_what_needs_a_restart(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """SIGHUP re-read only the signatures (and said `signature_table_reloaded`), ignoring a
        new unit: now a unit added to the config is supervised from then on, and a key only a
        restart applies is named."""
        sup = make_supervisor()
        with JournalWriter(tmp_path / "journal") as writer:
            sup.start()
            wait_for(sup.following, what="following")
            text = sup.config.read_text(encoding="utf-8")
            text = text.replace("restart_backoff_s = 0.1", "restart_backoff_s = 0.2")
            sup.config.write_text(text + '[[unit]]\nname = "sglang.service"\n', encoding="utf-8")
            os.kill(sup.pid, signal.SIGHUP)
            wait_for(lambda: events(sup, "config_reloaded"), what="the reload")
            [reloaded] = events(sup, "config_reloaded")
            assert reloaded["added"] == ["sglang.service"]
            assert reloaded["not_reloaded"] == ["journal.restart_backoff_s"]
            writer.write(fatal_crash("sglang.service", "b1" * 16, pid=1400, restarts=None))
            [crashed] = history_of(tmp_path / "state", 1)
        assert crashed["unit"] == "sglang.service"
        assert sup.terminate() == 0

    def test_the_metrics_port_in_use_does_not_stop_supervision(
        self, tmp_path: Path, make_supervisor: SupervisorFactory
    ) -> None:
        """The metrics port already taken: one clear error line, then supervision goes on
        without /metrics (the daemon exited)."""
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            sup = make_supervisor()
            sup.config.write_text(
                sup.config.read_text().replace(
                    'listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"'
                )
            )
            with JournalWriter(tmp_path / "journal") as writer:
                writer.write(crash("fatal", 1))
                sup.start()
                [halted] = history_of(tmp_path / "state", 1)
            [unavailable] = events(sup, "metrics_unavailable")
        assert halted["decision"]["action"] == "halt"
        assert (tmp_path / QUARANTINE).exists()
        assert "supervising without /metrics" in unavailable["action"]
        assert sup.terminate() == 0

    def test_the_reader_child_ignores_a_checkout_in_the_working_directory(
        self, tmp_path: Path
    ) -> None:
        """Run from inside a checkout (its `supervisor/` without the built reader), the reader
        child, then a Python module, imported `./supervisor` ("cannot import name
        '_sdjournal'") and read nothing; the installed reader runs whatever the directory."""
        shadow = tmp_path / "checkout"
        shutil.copytree(
            REPO / "supervisor",
            shadow / "supervisor",
            ignore=shutil.ignore_patterns("*.so", "vllm-supervisor-journal-reader"),
        )
        journal = tmp_path / "journal"
        with JournalWriter(journal) as writer:
            writer.write(crash("fatal", 1))
        script = shutil.which("vllm-supervisor")
        assert script is not None, "the package's console script is installed (pip install)"
        result = subprocess.run(
            [script, "triage", "--format", "json", str(journal)],
            cwd=shadow, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        [crashed] = json.loads(result.stdout)["invocations"]
        assert crashed["verdict"]["signature"] == "flashinfer_cubin_mismatch"


class TestTheGateFindsTheDaemon:
    def test_a_non_default_runtime_dir_from_the_installed_config(self, tmp_path: Path) -> None:
        """`gate %n` (no flags, from the served unit) read no config and failed open on a
        non-default `state.runtime_dir`: it now reads the installed config (here named by
        VLLM_SUPERVISOR_CONFIG, as /etc/vllm-supervisor/supervisor.toml is in production)."""
        runtime = tmp_path / "custom-run"
        config = tmp_path / "supervisor.toml"
        config.write_text(
            f'[state]\nruntime_dir = "{runtime}"\nstate_dir = "{tmp_path / "state"}"\n'
            '[[unit]]\nname = "vllm.service"\n',
            encoding="utf-8",
        )
        (runtime / "quarantine").mkdir(parents=True)
        (runtime / "quarantine" / f"{UNIT}.json").write_text('{"signature": "x"}\n')
        env = {**os.environ, "VLLM_SUPERVISOR_CONFIG": str(config)}
        gate = subprocess.run(
            [sys.executable, "-m", "vllm_supervisor", "gate", UNIT],
            env=env, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert gate.returncode == 1, gate.stderr
        assert "start refused, quarantined" in gate.stderr

    def test_without_a_daemon_the_start_goes_with_one_line(self, tmp_path: Path) -> None:
        """No daemon listening: the gate lets the start go and says so in one line."""
        config = tmp_path / "supervisor.toml"
        config.write_text(
            f'[state]\nruntime_dir = "{tmp_path / "run"}"\nstate_dir = "{tmp_path / "s"}"\n',
            encoding="utf-8",
        )
        gate = subprocess.run(
            [sys.executable, "-m", "vllm_supervisor", "gate", UNIT, "--config", str(config)],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert gate.returncode == 0
        assert gate.stderr.count("\n") == 1
        assert "start allowed: no supervisor is running" in gate.stderr


HALTED = f'vllm_supervisor_unit_halted{{unit="{UNIT}"}}'
HALTS = f'vllm_supervisor_halts_total{{reason="fatal_signature",unit="{UNIT}"}}'


def _metric(sup: Supervisor, series: str) -> float:
    """One series from the daemon's /metrics (the port it logged)."""
    [listening] = events(sup, "metrics_listening")
    url = f"http://127.0.0.1:{listening['port']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{series} not in /metrics")
