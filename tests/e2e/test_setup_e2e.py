"""deploy/README.md on a bare systemd 252 (in systemd-nspawn): the wheel `python -m build` made
of this checkout, installed into a root-owned venv (/opt/vllm-supervisor) of the distribution's
python3, then `vllm-supervisor setup`: one command to a supervised, halted crash loop, and
`setup --uninstall --purge` leaves nothing.

The container has none of the deploy files: the wheel and its dependencies' wheels are installed
as on a host without an index, the config names the served unit, and setup writes the
supervisor's unit, its user, the served unit's gate drop-in, the polkit rule (generated from
the config's unit names) and the catalog. Before, installing took ~15 hand-typed commands and
a hand-edited polkit rule.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from nspawn import Container, booted_container, wait_for
from packaged import Built, wheelhouse
from served import (
    DATA,
    REPO,
    SEED_LOG,
    UNIT,
    invocations_that_ran,
    quarantined,
    settled,
    supervisor_events,
)

pytestmark = pytest.mark.nspawn

INSTALLED_VENV = "/opt/vllm-supervisor"  # where deploy/README.md installs
COMMAND = f"{INSTALLED_VENV}/bin/vllm-supervisor"
VENV = "/home/ops/venv"  # a served venv under /home: hidden by the daemon's ProtectHome=
CONFIG = f"""[[unit]]
name = "{UNIT}"
python = "{VENV}/bin/python"

[metrics]
listen = "127.0.0.1:9464"
"""
SERVED = f"""[Unit]
StartLimitIntervalSec=0
[Service]
ExecStart=/usr/bin/python3 /opt/vsup/e2e/fake-server.py --log {SEED_LOG}
Restart=always
RestartSec=100ms
"""
ENVIRONMENTS = "/etc/systemd/system/vllm-supervisor.service.d/20-served-environments.conf"
INSTALLED = (
    ENVIRONMENTS,
    "/etc/systemd/system/vllm-supervisor.service",
    "/etc/sysusers.d/vllm-supervisor.conf",
    "/etc/polkit-1/rules.d/50-vllm-supervisor.rules",
    f"/etc/systemd/system/{UNIT}.d/10-vllm-supervisor.conf",
    "/usr/local/lib/systemd/catalog/vllm-supervisor.catalog",
    "/usr/local/share/man/man1/vllm-supervisor.1",
    "/usr/local/share/bash-completion/completions/vllm-supervisor",
    "/usr/local/share/zsh/site-functions/_vllm-supervisor",
)


@pytest.fixture
def bare(tmp_path: Path, built: Built) -> Iterator[Container]:
    """A booted container with the built wheel and the wheels of its dependencies, nothing
    installed. Its python3 is the host's /usr (Debian's), not the test's interpreter."""
    # The container's /usr is the host's, read-only: what setup writes under /usr/local.
    local_lib, local_share = tmp_path / "local-lib", tmp_path / "local-share"
    local_lib.mkdir()
    local_share.mkdir()
    binds = [
        (built.wheel.parent, "/opt/vsup/dist"),
        (wheelhouse(), "/opt/vsup/wheels"),
        (REPO, "/opt/vsup/src"),
        (DATA, "/opt/vsup/e2e"),
    ]
    with booted_container(
        binds,
        workdir=tmp_path,
        writable=[(local_lib, "/usr/local/lib"), (local_share, "/usr/local/share")],
    ) as booted:
        yield booted


def install_wheel(box: Container, built: Built) -> None:
    """deploy/README.md's install, from wheels only (the container has no index)."""
    script = (
        f"set -e; python3 -m venv {INSTALLED_VENV};"
        f" {INSTALLED_VENV}/bin/pip install -q --disable-pip-version-check --no-index"
        f" --find-links /opt/vsup/wheels /opt/vsup/dist/{built.wheel.name}"
    )
    done = box.run("sh", "-c", script, timeout=300, check=False)
    assert done.returncode == 0, (
        f"the wheel {built.wheel.name} did not install into the container's python3"
        f" ({box.run('python3', '-V').stdout.strip()}): {done.stderr[-2000:]}"
    )


def exists(box: Container, path: str) -> bool:
    return box.run("test", "-e", path, check=False).returncode == 0


def refuse_what_root_must_not_run(box: Container) -> None:
    """A program under /home (ProtectHome= hides it from the daemon: status=203/EXEC) and one
    in a venv another account owns (root would run its code) are refused in one line, exit 2,
    before anything is written."""
    box.run("/usr/bin/python3", "-m", "venv", "--without-pip", "/home/ops/vs")
    box.run("chown", "-R", "65534:65534", "/home/ops/vs")
    cases = [(f"{VENV}/bin/python", "ProtectHome="), ("/home/ops/vs/bin/python", "another account")]
    for program, said in cases:
        refused = box.run(COMMAND, "setup", "--program", program, check=False)
        assert refused.returncode == 2 and said in refused.stderr, refused
        assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
        assert [p for p in INSTALLED if exists(box, p)] == []


def test_setup_halts_a_fatal_loop_and_uninstall_leaves_nothing(
    bare: Container, built: Built
) -> None:
    """The wheel installed → setup (twice: idempotent) → the fatal crash halted at the first
    run, read by the wheel's native reader under the unit's sandbox → uninstall."""
    install_wheel(bare, built)
    bare.run("/usr/bin/python3", "-m", "venv", "--without-pip", VENV)
    bare.write_file("/etc/vllm-supervisor/supervisor.toml", CONFIG)
    bare.write_file(f"/etc/systemd/system/{UNIT}", SERVED)
    # /etc started empty (--volatile): journald made its files before sysusers made the
    # systemd-journal group; a real host has the group from the start (see served.py).
    bare.run(
        "sh", "-c", "chgrp -R systemd-journal /run/log/journal; chmod -R g+rX /run/log/journal"
    )
    bare.systemctl("restart", "systemd-journald")
    refuse_what_root_must_not_run(bare)
    done = bare.run(COMMAND, "setup", timeout=120)
    first = done.stdout
    assert all(path in first for path in INSTALLED), first
    unit = bare.run("cat", "/etc/systemd/system/vllm-supervisor.service").stdout
    assert f"ExecStart={COMMAND} " in unit, unit
    # systemd 252 answered over D-Bus and knows the configured unit: nothing to warn about.
    assert "warning" not in done.stderr, done.stderr
    again = bare.run(COMMAND, "setup", timeout=120).stdout
    assert "0 file(s) changed" in again and "wrote" not in again
    rule = bare.run("cat", "/etc/polkit-1/rules.d/50-vllm-supervisor.rules").stdout
    assert f'var SUPERVISED_UNITS = ["{UNIT}"]' in rule
    binds = bare.run("cat", ENVIRONMENTS).stdout
    assert f"BindReadOnlyPaths={VENV}" in binds and "ProtectHome=tmpfs" in binds
    wait_for(
        lambda: bare.show("vllm-supervisor.service", "ActiveState")["ActiveState"] == "active",
        timeout=30,
        what="the supervisor to run",
    )
    check = bare.run(COMMAND, "check-config", "/etc/vllm-supervisor/supervisor.toml")
    assert "no gate drop-in" not in check.stderr
    bare.systemctl("start", "--no-block", UNIT)
    wait_for(lambda: (quarantined(bare) and settled(bare)) or None, timeout=60,
             what="the served unit halted")  # fmt: skip
    assert len(invocations_that_ran(bare)) == 1
    assert bare.run(COMMAND, "status", check=False).returncode == 1
    readers = [e.get("reader") for e in supervisor_events(bare, "following_journal")]
    assert readers and set(readers) == {"native"}, readers
    # Drift sees the served venv through the bind (before: drift_blind, nothing recorded).
    wait_for(lambda: supervisor_events(bare, "environment_recorded"), timeout=20,
             what="the served environment recorded")  # fmt: skip
    assert not supervisor_events(bare, "drift_blind")
    security = bare.run("systemd-analyze", "security", "--no-pager", "vllm-supervisor.service")
    [line] = [x for x in security.stdout.splitlines() if "Overall exposure level" in x]
    assert float(line.split(":")[1].split()[0]) <= 2.0, line

    gone = bare.run(COMMAND, "setup", "--uninstall", "--purge", timeout=120).stdout
    assert "uninstalled" in gone
    assert [p for p in INSTALLED if exists(bare, p)] == []
    assert not exists(bare, "/var/lib/vllm-supervisor") and not exists(bare, "/run/vllm-supervisor")
    assert bare.run("getent", "passwd", "vllm-supervisor", check=False).returncode != 0
    load = bare.show("vllm-supervisor.service", "LoadState")["LoadState"]
    assert load == "not-found"
