"""A booted container with the shipped deploy files, a fake served unit, and ways to read it.

The container boots the host's own OS tree with the shipped deploy files bound in at their
install paths: the supervisor unit, the served unit's ExecCondition drop-in, the polkit rule and
the sysusers.d entry that creates the `vllm-supervisor` user. A fake `vllm.service` prints a saved
crash log and exits 1 under `Restart=always`. No test overrides the supervisor unit: the only
test-specific drop-in sets the served unit's RestartSec=, and the repository and this Python are
bound under /opt and reached through a wrapper at /usr/local/bin/vllm-supervisor, because the
test Python may live under /root or /home, which the unit's ProtectHome=yes hides. Run from a
venv (scripts/install-deps makes .venv), the venv's site-packages is bound beside its base
Python and put on PYTHONPATH: a venv's own interpreter names its base by an absolute path.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from nspawn import Container, booted_container, wait_for

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

# The test Python's base installation and the site-packages it imports from (the venv's when
# it runs in one, else the base's own), relocated under /opt: its RUNPATH may point into /root.
PYTHON = "/opt/vsup/python"
SITE = "/opt/vsup/site"
PYTHON_BINDS = [(sys.base_prefix, PYTHON), (sysconfig.get_path("purelib"), SITE)]
WRAPPER = f"""#!/bin/sh
# The test Python, relocated under /opt, running this checkout's package with its dependencies.
export LD_LIBRARY_PATH={PYTHON}/lib PYTHONPATH=/opt/vsup/src:{SITE} PYTHONDONTWRITEBYTECODE=1
exec {PYTHON}/bin/python3 -m supervisor "$@"
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
# Pacing held to a second or two, for the tests of what comes after several restarts (the
# shipped schedule holds the 2nd crash's restart a minute: tests/e2e/test_pacing_e2e.py).
FAST_PACE = "pace_first_s = 1\npace_max_s = 2\n"
FAST_PACED_CONFIG = SUPERVISOR_CONFIG.replace(
    "unknown_repeat_limit = 3\n", f"unknown_repeat_limit = 3\n{FAST_PACE}"
)

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


@pytest.fixture
def container(tmp_path: Path) -> Iterator[Container]:
    """A booted container with the shipped deploy files installed."""
    with deployed_container(tmp_path) as booted:
        yield booted


@contextlib.contextmanager
def deployed_container(
    tmp_path: Path, writable: Sequence[tuple[str | Path, str]] = ()
) -> Iterator[Container]:
    """Boot a container with the shipped deploy files (also used by `bench.exit_latency`);
    `writable` binds (host path, container path) outlive it, as a disk outlives a reboot."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    wrapper = bindir / "vllm-supervisor"
    wrapper.write_text(WRAPPER)
    wrapper.chmod(0o755)
    binds = [
        *PYTHON_BINDS,
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
        (DEPLOY / "catalog", "/opt/vsup/catalog"),
    ]
    with booted_container(binds, workdir=tmp_path, writable=writable) as booted:
        yield booted


def install_catalog(box: Container) -> None:
    """Install the shipped catalog as `setup` does on a host: journalctl reads catalogs from
    /usr/{local/,}lib/systemd/catalog only, and the container's /usr is the host's, read-only,
    so the database is built under a root of its own and put where `journalctl -x` reads it."""
    script = (
        "set -e; r=/run/catalog-root; d=$r/usr/local/lib/systemd/catalog; mkdir -p $d"
        " /var/lib/systemd/catalog; cp /usr/lib/systemd/catalog/*.catalog"
        " /opt/vsup/catalog/*.catalog $d/; journalctl --root=$r --update-catalog;"
        " cp $r/var/lib/systemd/catalog/database /var/lib/systemd/catalog/database"
    )
    box.run("sh", "-c", script)


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
        # systemd 252 sometimes fails the credential setup with EPROTO (systemd/systemd#33953),
        # the unit's Restart=on-failure recovers; on a loaded host it failed five times in a
        # row and hit the start limit: start it afresh then, as a person would.
        state = box.show("vllm-supervisor.service", "ActiveState")["ActiveState"]
        if state == "failed":
            box.systemctl("reset-failed", "vllm-supervisor.service", check=False)
            box.systemctl("start", "vllm-supervisor.service", check=False)
        return state == "active"

    try:
        wait_for(active, timeout=60, what="vllm-supervisor.service to be active", interval=0.2)
    except TimeoutError:
        log = box.run("journalctl", "--no-pager", "-u", "vllm-supervisor.service", check=False)
        pytest.fail(f"vllm-supervisor.service did not start:\n{log.stdout[-4000:]}")
    wait_for(lambda: following(box), timeout=20, what="the supervisor to follow the journal")


def following(box: Container) -> bool:
    """True once the supervisor's journal reader runs (it logs `following_journal`).

    The shipped unit's hardening must let the native libsystemd reader run: it is the default.
    """
    events = supervisor_events(box, "following_journal")
    assert all(event.get("reader") == "native" for event in events), events
    return bool(events)


def supervisor_events(box: Container, name: str) -> list[dict[str, Any]]:
    """The supervisor's own log events of one kind. Under systemd they are native journal
    entries (EVENT, with the whole event in EVENT_JSON); a JSON line on stderr is read too."""
    found = []
    for entry in box.journal("-u", "vllm-supervisor.service"):
        if entry.get("EVENT") == name and "EVENT_JSON" in entry:
            found.append(json.loads(entry["EVENT_JSON"]))
            continue
        text = str(entry.get("MESSAGE"))
        if text.startswith("{") and f'"event": "{name}"' in text:
            found.append(json.loads(text))
    return found


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
