"""End to end under a real systemd 252 (in systemd-nspawn): restart loops halted for real.

The container boots the host's own OS tree with the shipped deploy files bound in at their
install paths: the supervisor unit, the served unit's ExecCondition drop-in, the polkit rule and
the sysusers.d entry that creates the `vllm-supervisor` user. A fake `vllm.service` prints a saved
crash log and exits 1 under `Restart=always`. No test overrides the supervisor unit: the only
test-specific drop-in sets the served unit's RestartSec=, and the repository and this Python are
bound under /opt and reached through a wrapper at /usr/local/bin/vllm-supervisor, because the
test Python lives under /root, which the unit's ProtectHome=yes hides.

These tests fail (never skip) when nspawn cannot run: they are the proof that halting works.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nspawn import Container, booted_container, wait_for

pytestmark = pytest.mark.nspawn

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DATA = Path(__file__).resolve().parent / "data"
UNIT = "vllm.service"
SEED_LOG = "/opt/vsup/src/supervisor/data/seed-flashinfer-crash.log"
NCCL_LOG = "/opt/vsup/e2e/nccl-timeout.log"
UNKNOWN_LOG = "/opt/vsup/e2e/unknown-crash.log"
QUARANTINE = "/run/vllm-supervisor/quarantine/vllm.service.json"

SERVER_BANNER = "vLLM API server version"  # the first line of every crash log in data/
PROCESS_EXITED = "98e322203f7a4ed290d09fe03c09fe15"
JOB_STARTED = "39f53479d3a045ac8e11786248231fbf"
JOB_STOPPED = "9d1aaa27d60140bd96365438aad20286"
CONDITION_SKIPPED = "0e4284a0caca4bfc81c0bb6786972673"

WRAPPER = """#!/bin/sh
# The test Python, relocated under /opt (its RUNPATH points into /root, hidden by ProtectHome).
export LD_LIBRARY_PATH=/opt/vsup/python/lib PYTHONPATH=/opt/vsup/src PYTHONDONTWRITEBYTECODE=1
exec /opt/vsup/python/bin/python3 -m supervisor "$@"
"""

SERVED_UNIT = """[Unit]
Description=fake inference server for the e2e tests
# A model that loads for minutes never trips the start limit; keep the fast fake just as free.
StartLimitIntervalSec=0

[Service]
ExecStart=/opt/vsup/e2e/fake-server.sh {log}
Restart=always
"""

SUPERVISOR_CONFIG = """[[unit]]
name = "vllm.service"
unknown_repeat_limit = 3

[metrics]
listen = "127.0.0.1:9464"
"""

HUNG_UNIT = """[Unit]
Description=fake inference server whose engine dies while its API server keeps answering 500
StartLimitIntervalSec=0

[Service]
ExecStart=/usr/bin/python3 /opt/vsup/e2e/fake-hung-engine.py {log} {port}
Restart=always
"""

HANG_GRACE_S = 2.0
HANG_CONFIG = """[[unit]]
name = "vllm.service"
health_url = "http://127.0.0.1:{port}/health"
hang_grace_s = {grace}

[metrics]
listen = "127.0.0.1:9464"
"""
ENGINE_DEAD = "EngineDeadError"

LATENCIES: list[float] = []


@pytest.fixture
def container(tmp_path: Path) -> Iterator[Container]:
    """A booted container with the shipped deploy files installed."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "vllm-supervisor"
    wrapper.write_text(WRAPPER)
    wrapper.chmod(0o755)
    binds = [
        (sys.base_prefix, "/opt/vsup/python"),
        (REPO, "/opt/vsup/src"),
        (DATA, "/opt/vsup/e2e"),
        (bindir, "/usr/local/bin"),
        (DEPLOY / "systemd/vllm-supervisor.service", "/etc/systemd/system/vllm-supervisor.service"),
        (
            DEPLOY / "systemd/vllm.service.d/10-vllm-supervisor.conf",
            "/etc/systemd/system/vllm.service.d/10-vllm-supervisor.conf",
        ),
        (
            DEPLOY / "polkit/50-vllm-supervisor.rules",
            "/etc/polkit-1/rules.d/50-vllm-supervisor.rules",
        ),
        (DEPLOY / "sysusers.d/vllm-supervisor.conf", "/etc/sysusers.d/vllm-supervisor.conf"),
    ]
    assert sys.prefix == sys.base_prefix, "run the e2e tests with a non-venv Python"
    with booted_container(binds, workdir=tmp_path) as booted:
        yield booted


def install_served_unit(box: Container, log: str, restart_sec: str) -> None:
    """Write the fake served unit and the test's RestartSec= drop-in, then reload systemd."""
    box.write_file(f"/etc/systemd/system/{UNIT}", SERVED_UNIT.format(log=log))
    box.write_file(
        f"/etc/systemd/system/{UNIT}.d/50-e2e-restartsec.conf",
        f"[Service]\nRestartSec={restart_sec}\n",
    )
    box.systemctl("daemon-reload")


def install_hung_unit(box: Container, log: str) -> int:
    """The fake hung engine as the served unit, and a supervisor config that watches its health.

    Returns the loopback port of its health URL (the container shares the host's network).
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    box.write_file(f"/etc/systemd/system/{UNIT}", HUNG_UNIT.format(log=log, port=port))
    box.systemctl("daemon-reload")
    return port


def start_supervisor(box: Container, config: str = SUPERVISOR_CONFIG) -> None:
    """Start the shipped supervisor unit and wait until it is active (it sent READY=1)."""
    # The container's /etc starts empty (--volatile=yes): journald created its files before
    # systemd-sysusers made the systemd-journal group, so they are root:root and the daemon's
    # SupplementaryGroups=systemd-journal cannot read them. A real host has the group from the
    # start; give the files that group and let journald pick it up, as a first boot would.
    box.run("chgrp", "-R", "systemd-journal", "/run/log/journal")
    box.run("chmod", "-R", "g+rX", "/run/log/journal")
    box.systemctl("restart", "systemd-journald")
    box.write_file("/etc/vllm-supervisor/supervisor.toml", config)
    # An empty credential file means "Slack off"; LoadCredential= fails the unit without it.
    box.write_file("/etc/vllm-supervisor/slack-webhook", "", mode="0600")
    box.systemctl("start", "vllm-supervisor.service", check=False)

    def active() -> bool:
        # systemd 252 in nspawn sometimes fails the first credential setup with EPROTO;
        # the unit's Restart=on-failure recovers, which is what production relies on too.
        return box.show("vllm-supervisor.service", "ActiveState")["ActiveState"] == "active"

    try:
        wait_for(active, timeout=20, what="vllm-supervisor.service to be active", interval=0.2)
    except TimeoutError:
        log = box.run("journalctl", "--no-pager", "-u", "vllm-supervisor.service", check=False)
        pytest.fail(f"vllm-supervisor.service did not start:\n{log.stdout[-4000:]}")
    wait_for(lambda: following(box), timeout=20, what="the supervisor to follow the journal")


def following(box: Container) -> bool:
    """True once the supervisor's journal reader runs (it logs `following_journal`).

    The shipped unit's hardening must let the native libsystemd reader run: it is the default.
    """
    lines = box.journal("-u", "vllm-supervisor.service")
    events = [str(e.get("MESSAGE")) for e in lines if "following_journal" in str(e.get("MESSAGE"))]
    assert all('"reader": "native"' in event for event in events), events
    return bool(events)


def history(box: Container) -> list[dict[str, Any]]:
    """What the daemon classified so far (`vllm-supervisor history --format json`)."""
    out = box.run("vllm-supervisor", "history", "--format", "json").stdout
    return list(json.loads(out)["invocations"])


def at_least(items: list[dict[str, Any]], count: int) -> list[dict[str, Any]] | None:
    """`items` once there are `count` of them, else None (for wait_for)."""
    return items if len(items) >= count else None


def settled(box: Container) -> bool:
    """True when the served unit is down with no start or restart pending."""
    state = box.show(UNIT, "ActiveState", "SubState")
    jobs = box.systemctl("list-jobs", "--no-legend").stdout
    return (
        state["ActiveState"] in ("inactive", "failed")
        and UNIT not in jobs
        and (state["SubState"] in ("dead", "failed"))
    )


def unit_lines(box: Container) -> list[dict[str, str]]:
    """Every journal entry about the served unit: its own lines and PID 1's messages."""
    return box.journal("-u", UNIT)


def invocations_that_ran(box: Container) -> set[str]:
    """One key per run of the served unit's ExecStart: the process that printed its banner.

    Keyed by _PID, not by invocation id: journald reads the id from the cgroup and can miss
    it on a line printed as the process exits, and a start the gate skips prints nothing.
    """
    return {
        str(e.get("_PID"))
        for e in unit_lines(box)
        if e.get("_SYSTEMD_UNIT") == UNIT and SERVER_BANNER in str(e.get("MESSAGE"))
    }


def condition_skips(box: Container) -> int:
    """How often systemd skipped a start of the served unit because ExecCondition failed."""
    return sum(1 for e in unit_lines(box) if e.get("MESSAGE_ID") == CONDITION_SKIPPED)


def n_restarts(box: Container) -> int:
    """systemd's restart counter of the served unit."""
    return int(box.show(UNIT, "NRestarts")["NRestarts"])


def quarantined(box: Container) -> bool:
    """True once the supervisor wrote the served unit's quarantine record."""
    return box.run("test", "-f", QUARANTINE, check=False).returncode == 0


def started_entries(entries: list[dict[str, str]]) -> list[dict[str, str]]:
    """PID 1's "Started U." messages of starts that ran the server.

    systemd 252 logs a start the gate skipped with the same MESSAGE_ID and JOB_RESULT=done
    ("Condition check resulted in U being skipped."), after the skip's own message
    (CONDITION_SKIPPED) about the same invocation: those are left out.
    """
    skipped = {e.get("INVOCATION_ID") for e in entries if e.get("MESSAGE_ID") == CONDITION_SKIPPED}
    return [
        e
        for e in entries
        if e.get("MESSAGE_ID") == JOB_STARTED and e.get("INVOCATION_ID") not in skipped
    ]


def ts(entry: dict[str, str]) -> int:
    """The entry's wall-clock time in microseconds."""
    return int(entry["__REALTIME_TIMESTAMP"])


def halt_latency(box: Container) -> tuple[float, float]:
    """Seconds from the halted invocation's exit to (quarantine written, unit kept down)."""
    entries = unit_lines(box)
    record = json.loads(box.run("cat", QUARANTINE).stdout)
    exits = [
        e
        for e in entries
        if e.get("MESSAGE_ID") == PROCESS_EXITED
        and e.get("INVOCATION_ID") == record["invocation_id"]
    ]
    assert exits, f"no exit entry for the quarantined invocation {record['invocation_id']}"
    exited = ts(exits[0])
    mtime_us = int(box.run("stat", "-c", "%.6Y", QUARANTINE).stdout.strip().replace(".", ""))
    down = [
        ts(e)
        for e in entries
        if e.get("MESSAGE_ID") in (JOB_STOPPED, CONDITION_SKIPPED) and ts(e) >= exited
    ]
    assert down, "the unit was neither stopped nor skipped after the halt"
    return (mtime_us - exited) / 1e6, (min(down) - exited) / 1e6


class TestSystemdMechanism:
    """What the halting design relies on, proven on this systemd without the daemon."""

    def test_unit_crash_loops_under_restart_always(self, container: Container) -> None:
        """A crashing unit with Restart=always is restarted again and again by systemd."""
        install_served_unit(container, SEED_LOG, "100ms")
        container.systemctl("start", "--no-block", UNIT)
        wait_for(lambda: n_restarts(container) >= 3, timeout=30, what="three restarts")

    def test_gate_skips_start_and_stops_the_loop(self, container: Container) -> None:
        """With a quarantine record the ExecCondition gate skips the start and nothing restarts."""
        install_served_unit(container, SEED_LOG, "100ms")
        container.write_file(QUARANTINE, '{"signature": "manual", "reason": "e2e"}\n', "0640")
        container.systemctl("start", UNIT, check=False)
        wait_for(
            lambda: condition_skips(container), timeout=20, what="the start skipped by the gate"
        )
        assert n_restarts(container) == 0
        assert invocations_that_ran(container) == set()
        state = container.show(UNIT, "ActiveState", "SubState", "Result")
        assert state["ActiveState"] == "inactive"
        assert state["SubState"] == "dead"

    def test_release_lets_the_unit_start_again(self, container: Container) -> None:
        """`vllm-supervisor release` removes the record and the next start runs the server."""
        install_served_unit(container, SEED_LOG, "30s")
        container.write_file(QUARANTINE, '{"signature": "manual"}\n', "0640")
        container.systemctl("start", UNIT, check=False)
        out = container.run("vllm-supervisor", "release", UNIT).stdout
        assert "released vllm.service" in out
        container.systemctl("start", UNIT, check=False)
        wait_for(
            lambda: len(invocations_that_ran(container)) == 1,
            timeout=20,
            what="the released unit to run",
        )


def test_supervisor_unit_exposure_is_at_most_2(container: Container) -> None:
    """`systemd-analyze security` rates the shipped unit, as installed, 2.0 or better."""
    out = container.run(
        "systemd-analyze", "security", "--no-pager", "vllm-supervisor.service"
    ).stdout
    [line] = [x for x in out.splitlines() if "Overall exposure level" in x]
    score = float(line.split(":")[1].split()[0])
    print(f"\n{line.strip()}")
    assert score <= 2.0, out[-3000:]


class TestSupervisorHalts:
    """The shipped supervisor unit against a crash-looping served unit."""

    @pytest.mark.parametrize("restart_sec", ["0", "100ms", "10s"])
    def test_fatal_crash_is_halted_after_the_first_crash(
        self, container: Container, restart_sec: str
    ) -> None:
        """A known fatal crash is quarantined and the server never starts again, at any
        RestartSec= (systemd's default is 100ms): the next start's gate waits for the daemon's
        decision. The unit ends `inactive (dead)`, not `failed`, and the supervisor records no
        crash of its own doing."""
        install_served_unit(container, SEED_LOG, restart_sec)
        start_supervisor(container)
        container.systemctl("start", "--no-block", UNIT)
        wait_for(lambda: quarantined(container), timeout=30, what="the quarantine record")
        wait_for(lambda: settled(container), timeout=30, what="the served unit to stay down")
        record = json.loads(container.run("cat", QUARANTINE).stdout)
        assert record["signature"] == "flashinfer_cubin_mismatch"
        to_record, to_down = halt_latency(container)
        LATENCIES.append(to_down)
        print(
            f"\nRestartSec={restart_sec}: exit->quarantine {to_record:.3f}s, "
            f"exit->stopped/skipped {to_down:.3f}s, NRestarts={n_restarts(container)}"
        )
        mtime_us = int(
            container.run("stat", "-c", "%.6Y", QUARANTINE).stdout.strip().replace(".", "")
        )
        late = [e for e in started_entries(unit_lines(container)) if ts(e) > mtime_us]
        assert late == [], "systemd started the server again after the quarantine was written"
        assert len(invocations_that_ran(container)) == 1
        state = container.show(UNIT, "ActiveState", "SubState")
        assert (state["ActiveState"], state["SubState"]) == ("inactive", "dead")
        seen = history(container)
        # The crash, then (when the restart had begun) the start the gate refused: no crash
        # of the supervisor's own making (a StopUnit that killed the gate, say).
        assert [i["ending"] for i in seen] in (["exited"], ["exited", "skipped"]), seen
        assert (seen[0]["decision"]["action"], seen[0]["taken"]) == ("halt", "halted")
        assert all(i["decision"]["action"] == "observe" for i in seen[1:])

    def test_transient_crash_keeps_restarting(self, container: Container) -> None:
        """An NCCL watchdog timeout is transient: the supervisor lets every restart happen."""
        install_served_unit(container, NCCL_LOG, "300ms")
        start_supervisor(container)
        container.systemctl("start", "--no-block", UNIT)
        seen = wait_for(
            lambda: at_least(history(container), 4),
            timeout=40,
            what="four classified NCCL crashes",
        )
        assert {i["verdict"]["signature"] for i in seen} == {"nccl_timeout"}
        assert all(i["decision"]["action"] != "halt" for i in seen)
        assert not quarantined(container)
        before = n_restarts(container)
        wait_for(lambda: n_restarts(container) > before, timeout=20, what="yet another restart")
        container.systemctl("stop", UNIT)

    def test_unknown_crash_is_halted_on_the_third_repeat(self, container: Container) -> None:
        """The same unknown crash three times in a row is halted on the third, not before."""
        install_served_unit(container, UNKNOWN_LOG, "300ms")
        start_supervisor(container)
        container.systemctl("start", "--no-block", UNIT)
        wait_for(lambda: quarantined(container), timeout=40, what="the quarantine record")
        wait_for(lambda: settled(container), timeout=30, what="the served unit to stay down")
        actions = [i["decision"]["action"] for i in history(container)]
        assert actions[:3] == ["allow-restart", "allow-restart", "halt"], actions
        assert len(invocations_that_ran(container)) == 3
        # Two restarts ran. NRestarts may count a third that was scheduled and then cancelled
        # by the stop or skipped by the gate, so judge by what systemd actually started.
        mtime_us = int(
            container.run("stat", "-c", "%.6Y", QUARANTINE).stdout.strip().replace(".", "")
        )
        started_late = [e for e in started_entries(unit_lines(container)) if ts(e) > mtime_us]
        assert started_late == []
        _, to_down = halt_latency(container)
        LATENCIES.append(to_down)


def death_us(box: Container) -> int:
    """When the served unit logged its (first) EngineDeadError line."""
    deaths = [
        ts(e)
        for e in unit_lines(box)
        if e.get("_SYSTEMD_UNIT") == UNIT and ENGINE_DEAD in str(e.get("MESSAGE"))
    ]
    assert deaths, "the fake engine never logged its death"
    return min(deaths)


class TestHungEngine:
    """The engine dies, the API server stays up answering 500: systemd alone never reacts."""

    def test_hung_engine_with_a_fatal_cause_is_halted(self, container: Container) -> None:
        """EngineDeadError after the seed's flashinfer crash, /health at 500: halted in grace."""
        port = install_hung_unit(container, SEED_LOG)
        start_supervisor(container, HANG_CONFIG.format(port=port, grace=HANG_GRACE_S))
        container.systemctl("start", "--no-block", UNIT)
        wait_for(lambda: quarantined(container), timeout=30, what="the quarantine record")
        wait_for(lambda: settled(container), timeout=30, what="the served unit to stay down")
        [record] = history(container)
        assert record["hung"] is True
        assert record["verdict"]["signature"] == "flashinfer_cubin_mismatch"
        assert record["decision"]["action"] == "halt"
        # The unit never exited on its own: systemd did not restart it, the supervisor stopped it.
        assert n_restarts(container) == 0
        assert len(invocations_that_ran(container)) == 1
        mtime_us = int(
            container.run("stat", "-c", "%.6Y", QUARANTINE).stdout.strip().replace(".", "")
        )
        handled_after = (mtime_us - death_us(container)) / 1e6
        print(f"\nhung engine (fatal): death line -> halted {handled_after:.3f}s")
        # The grace period, then a health check and a halt: a few seconds, not minutes.
        assert HANG_GRACE_S <= handled_after < HANG_GRACE_S + 5

    def test_hung_engine_with_a_transient_cause_is_restarted(self, container: Container) -> None:
        """EngineDeadError after an NCCL watchdog timeout: the supervisor restarts the unit."""
        port = install_hung_unit(container, NCCL_LOG)
        start_supervisor(container, HANG_CONFIG.format(port=port, grace=HANG_GRACE_S))
        container.systemctl("start", "--no-block", UNIT)
        wait_for(
            lambda: len(invocations_that_ran(container)) >= 2,
            timeout=30,
            what="the supervisor to restart the hung engine",
        )
        first = history(container)[0]
        assert first["hung"] is True
        assert first["verdict"]["signature"] == "nccl_timeout"
        assert first["decision"]["action"] == "allow-restart"
        assert not quarantined(container)
        died = death_us(container)
        restarted = min(ts(e) for e in started_entries(unit_lines(container)) if ts(e) > died)
        handled_after = (restarted - died) / 1e6
        print(f"\nhung engine (transient): death line -> restarted {handled_after:.3f}s")
        assert HANG_GRACE_S <= handled_after < HANG_GRACE_S + 5
        container.systemctl("stop", UNIT)


def teardown_module() -> None:
    """Print the measured exit -> stop latencies of this run."""
    if LATENCIES:
        print(
            f"\nexit->stop latency: median {statistics.median(LATENCIES):.3f}s, "
            f"worst {max(LATENCIES):.3f}s over {len(LATENCIES)} halts"
        )
