"""Decisions an operator can trust, under a real systemd 252 (in systemd-nspawn).

The situations of the trust issue that need systemd itself: the supervisor down while the
served unit crash-loops and is repaired, a person's stop and start meanwhile, a server that
exits 143 on SIGTERM, journald's rate limit, a non-default runtime directory, a crash that
exits 0 under `Restart=on-failure`, and the gate's cost on a start whose past is decided. Each
test failed on the code before the trust work (its docstring says how).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from nspawn import Container, wait_for
from served import (
    FAST_PACE,
    NCCL_LOG,
    SEED_LOG,
    UNIT,
    container,
    history,
    invocations_that_ran,
    n_restarts,
    quarantined,
    settled,
    start_supervisor,
    supervisor_events,
    unit_lines,
)
from slack_server import SlackServer

pytestmark = pytest.mark.nspawn
__all__ = ["container"]  # the fixture, used by name

FAKE = "/usr/bin/python3 /opt/vsup/e2e/fake-server.py"
BROKEN = "/run/vsup-e2e-broken"  # while this file exists the fake server crashes (fatal)
SERVING = "Uvicorn running on"
CONFIG = """[[unit]]
name = "vllm.service"

[metrics]
listen = "127.0.0.1:9464"
{extra}"""


def install(box: Container, exec_start: str, *, restart: str = "always", sec: str = "100ms",
            service: str = "") -> None:  # fmt: skip
    """The served unit with this ExecStart= (the shipped gate drop-in applies), reloaded.
    `service` goes into a drop-in that sorts after the shipped one, so it overrides it (the
    shipped one raises LogRateLimitBurst=, a test of journald's limit lowers it again)."""
    box.write_file(
        f"/etc/systemd/system/{UNIT}",
        f"[Unit]\nStartLimitIntervalSec=0\n[Service]\nExecStart={exec_start}\nRestart={restart}\n",
    )
    box.write_file(
        f"/etc/systemd/system/{UNIT}.d/50-e2e.conf", f"[Service]\nRestartSec={sec}\n{service}"
    )
    box.systemctl("daemon-reload")


def state(box: Container) -> dict[str, str]:
    """The served unit's state as systemd says it."""
    return box.show(UNIT, "ActiveState", "SubState", "InvocationID", "NRestarts")


def serving_now(box: Container) -> str | None:
    """The invocation id while the served unit runs and has logged that it serves."""
    now = state(box)
    if (now["ActiveState"], now["SubState"]) != ("active", "running"):
        return None
    serving = {
        e.get("_SYSTEMD_INVOCATION_ID") for e in unit_lines(box) if SERVING in str(e.get("MESSAGE"))
    }
    return now["InvocationID"] if now["InvocationID"] in serving else None


def stop_supervisor(box: Container) -> None:
    box.systemctl("stop", "vllm-supervisor.service")


@pytest.fixture
def slack() -> Iterator[SlackServer]:
    """A loopback Slack; the container shares this host's network."""
    server = SlackServer()
    server.start()
    yield server
    server.stop()


class TestBacklog:
    def test_a_loop_while_the_supervisor_was_down_stops_nothing_now(
        self, container: Container, slack: SlackServer
    ) -> None:
        """The unit crash-looped while the supervisor was down for maintenance, was repaired
        and serves when the supervisor comes back: the crashes are history, told in one
        message; the invocation serving now is not stopped (StopUnit stopped it, and the gate
        then refused every later start)."""
        install(container, f"{FAKE} --log {SEED_LOG} --fatal-if {BROKEN}")
        extra = "[slack]\nbacklog_hold_s = 1.0\nmin_interval_s = 0.01\n"
        start_supervisor(container, CONFIG.format(extra=extra))
        container.write_file("/etc/vllm-supervisor/slack-webhook", slack.url, mode="0600")
        stop_supervisor(container)  # maintenance: its cursor is saved
        container.write_file(BROKEN, "")
        container.systemctl("start", "--no-block", UNIT)
        wait_for(lambda: int(state(container)["NRestarts"]) >= 5, timeout=30, what="5 restarts")
        container.run("rm", "-f", BROKEN)  # repaired: the next restart serves
        serving = wait_for(lambda: serving_now(container), timeout=30, what="the unit serving")
        crashes = len(invocations_that_ran(container)) - 1
        container.systemctl("start", "vllm-supervisor.service")
        wait_for(lambda: len(history(container)) >= crashes, timeout=30, what="the backlog read")
        wait_for(lambda: all(i["notified"] for i in history(container)), timeout=30, what="told")
        seen = history(container)
        assert {i["taken"] for i in seen} == {"recorded"}
        assert {i["verdict"]["signature"] for i in seen} == {"flashinfer_cubin_mismatch"}
        assert state(container)["InvocationID"] == serving  # the serving run was left alone
        assert not quarantined(container)
        assert slack.count() == 1
        assert f"{crashes} past crashes read late" in slack.requests[0].json()["text"]

    def test_a_stop_and_start_while_the_supervisor_was_down(self, container: Container) -> None:
        """The supervisor stopped for maintenance; meanwhile a person stops and starts the
        served unit; the supervisor replays from its cursor without dying (KeyError in
        InvocationTracker._close, restarted until start-limit-hit, nothing supervised)."""
        install(container, f"{FAKE} --serve")
        start_supervisor(container)
        container.systemctl("start", UNIT)
        wait_for(lambda: serving_now(container), timeout=30, what="the unit serving")
        stop_supervisor(container)
        container.systemctl("stop", UNIT)
        container.systemctl("start", UNIT)
        now = wait_for(lambda: serving_now(container), timeout=30, what="the unit serving again")
        container.systemctl("start", "vllm-supervisor.service")
        stopped = wait_for(lambda: history(container) or None, timeout=30, what="the stop read")
        assert [i["decision"]["rule"] for i in stopped] == ["operator_stop"]
        wait_for(lambda: supervisor_events(container, "following_journal") or None, timeout=20,
                 what="following")  # fmt: skip
        sup = container.show("vllm-supervisor.service", "ActiveState", "NRestarts")
        assert (sup["ActiveState"], sup["NRestarts"]) == ("active", "0")
        assert state(container)["InvocationID"] == now


class TestOperatorStops:
    def test_a_server_that_exits_143_stopped_and_restarted_by_a_person(
        self, container: Container
    ) -> None:
        """A server that traps SIGTERM and exits 143: each stop or restart by a person was an
        unknown crash, and the third was halted."""
        install(container, f"{FAKE} --serve --term-status 143")
        start_supervisor(container)
        for verb in ("start", "stop", "start", "restart", "restart"):
            container.systemctl(verb, UNIT)
            if verb != "stop":
                wait_for(lambda: serving_now(container), timeout=30, what=f"serving after {verb}")
        wait_for(lambda: len(history(container)) >= 3, timeout=30, what="three stops decided")
        seen = history(container)
        assert [i["exit_status"] for i in seen] == [143] * 3
        assert [i["decision"]["rule"] for i in seen] == ["operator_stop"] * 3
        assert not quarantined(container)
        assert serving_now(container)


class TestRateLimit:
    def test_lines_journald_dropped_are_said(self, container: Container) -> None:
        """journald's rate limit drops a crash's lines (`Suppressed N messages`, logged only
        once the interval ends): no failed invocation says "No crash found", and the notice is
        added to the history of the invocations it concerns."""
        install(
            container,
            f"{FAKE} --spam 600 --log {SEED_LOG}",
            sec="1s",
            service="LogRateLimitIntervalSec=5s\nLogRateLimitBurst=50\n",
        )
        # Patient with unknown crashes, so the unit logs again after journald's interval: its
        # next line is when journald says what it dropped.
        start_supervisor(
            container,
            CONFIG.replace(
                '"vllm.service"', f'"vllm.service"\nunknown_repeat_limit = 100\n{FAST_PACE}'
            ).format(extra=""),
        )
        container.systemctl("start", "--no-block", UNIT)
        wait_for(
            lambda: supervisor_events(container, "journal_lines_suppressed") or None,
            timeout=60,
            what="journald's late notice of the lines it dropped",
        )
        container.systemctl("stop", UNIT)
        seen = history(container)
        assert seen
        assert all(i["verdict"]["title"] != "No crash found" for i in seen)
        notes = [n for i in seen for n in i["verdict"]["notes"]]
        assert any("journald dropped" in n for n in notes), notes


class TestGate:
    def test_a_non_default_runtime_dir_still_gates(self, container: Container) -> None:
        """`state.runtime_dir` set to a non-default path: the drop-in's `gate %n` read no config
        and failed open, so a person's start after the halt ran the crashing server again."""
        install(container, f"{FAKE} --log {SEED_LOG}", sec="10s")
        custom = "/run/vllm-supervisor/custom"
        start_supervisor(container, CONFIG.format(extra=f'[state]\nruntime_dir = "{custom}"\n'))
        container.systemctl("start", "--no-block", UNIT)
        record = f"{custom}/quarantine/{UNIT}.json"
        wait_for(
            lambda: container.run("test", "-f", record, check=False).returncode == 0,
            timeout=30,
            what="the quarantine record in the custom directory",
        )
        wait_for(lambda: settled(container), timeout=30, what="the unit down")
        container.systemctl("start", UNIT, check=False)
        wait_for(
            lambda: any("start refused, quarantined" in str(e.get("MESSAGE"))
                        for e in unit_lines(container)),
            timeout=20,
            what="the gate refusing the start",
        )  # fmt: skip
        assert len(invocations_that_ran(container)) == 1

    def test_a_start_after_release_is_not_delayed(self, container: Container) -> None:
        """The gate waits for the daemon only when there is something to decide: on a start
        whose past is decided (here after a halt and `release`) it adds under 50 ms."""
        install(container, f"{FAKE} --log {SEED_LOG}", sec="10s")
        start_supervisor(container)
        container.systemctl("start", "--no-block", UNIT)
        wait_for(lambda: quarantined(container), timeout=30, what="the halt")
        wait_for(lambda: settled(container), timeout=30, what="the unit down")
        container.run("vllm-supervisor", "release", UNIT)
        before = len(supervisor_events(container, "gate_answered"))
        container.systemctl("start", "--no-block", UNIT)
        answered = wait_for(
            lambda: supervisor_events(container, "gate_answered")[before:] or None,
            timeout=20,
            what="the gate's answer",
        )
        print(f"\ngate after release: waited {answered[0]['waited_ms']} ms for the daemon")
        assert answered[0]["decided"] is True
        assert answered[0]["waited_ms"] < 50
        wait_for(lambda: len(invocations_that_ran(container)) == 2, timeout=20, what="it ran")


class TestDownUnderOnFailure:
    def test_a_crash_that_exits_0_is_restarted(self, container: Container) -> None:
        """vLLM can exit 0 after its engine died (`Deactivated successfully`): under
        Restart=on-failure systemd leaves it down. It was a crash in history and nothing more;
        now the supervisor restarts it (a transient cause) and says so."""
        install(container, f"{FAKE} --log {NCCL_LOG} --exit 0", restart="on-failure", sec="1s")
        start_supervisor(container)
        container.systemctl("start", "--no-block", UNIT)
        wait_for(lambda: len(invocations_that_ran(container)) >= 2, timeout=30,
                 what="the supervisor to restart it")  # fmt: skip
        # The supervisor first: its next RestartUnit (mode replace) would cancel our stop job.
        container.systemctl("stop", "vllm-supervisor.service")
        container.systemctl("stop", UNIT)
        first = history(container)[0]
        assert first["result"] == "success"
        assert first["verdict"]["signature"] == "nccl_timeout"
        assert first["taken"] == "restarted"
        assert n_restarts(container) == 0  # systemd itself never restarted it


class TestReload:
    def test_systemctl_reload_rereads_the_config(self, container: Container) -> None:
        """The shipped unit had no ExecReload=: `systemctl reload` failed."""
        start_supervisor(container)
        container.systemctl("reload", "vllm-supervisor.service")
        wait_for(
            lambda: supervisor_events(container, "config_reloaded") or None,
            timeout=20,
            what="reload",
        )
