"""The shipped polkit rule under a real systemd 252 and polkitd (in systemd-nspawn).

The daemon's D-Bus rights must cover only the configured units: as the `vllm-supervisor` user
(created by the shipped sysusers.d entry at boot), StopUnit of `vllm.service` is allowed and
StopUnit of any other unit is refused, as is any verb other than stop and restart. One container
is booted for the whole module.

These tests fail (never skip) when nspawn cannot run: they are the proof of the privilege bound.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from nspawn import Container, booted_container, wait_for

pytestmark = pytest.mark.nspawn

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
USER = "vllm-supervisor"
SLEEPER = """[Unit]
Description=a stand-in unit for the polkit tests

[Service]
ExecStart=/bin/sleep infinity
"""
UNITS = ("vllm.service", "other.service")


@pytest.fixture(scope="module", name="box")
def _box(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    """A booted container with the shipped polkit rule and sysusers entry installed."""
    workdir = tmp_path_factory.mktemp("polkit-e2e")
    binds = [
        (
            DEPLOY / "polkit/50-vllm-supervisor.rules",
            "/etc/polkit-1/rules.d/50-vllm-supervisor.rules",
        ),
        (DEPLOY / "sysusers.d/vllm-supervisor.conf", "/etc/sysusers.d/vllm-supervisor.conf"),
    ]
    with booted_container(binds, workdir=workdir) as box:
        for unit in UNITS:
            box.write_file(f"/etc/systemd/system/{unit}", SLEEPER)
        box.systemctl("daemon-reload")
        box.run("getent", "passwd", USER)  # the sysusers entry was applied at boot
        yield box


@pytest.fixture(autouse=True)
def _both_running(box: Container) -> None:
    """Every test starts with both units active (started by root)."""
    for unit in UNITS:
        box.systemctl("start", unit)
    wait_for(
        lambda: all(box.show(u, "ActiveState")["ActiveState"] == "active" for u in UNITS),
        timeout=30,
        what="both units active",
    )


def _as_user(
    box: Container, user: str, *argv: str, group: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `argv` in the container as `user` (setpriv: no PAM session, no password agent)."""
    ids = [f"--reuid={user}", f"--regid={group or user}", "--init-groups"]
    return box.run("setpriv", *ids, "--", *argv, check=False, timeout=60)


def _as_supervisor(box: Container, *argv: str) -> subprocess.CompletedProcess[str]:
    return _as_user(box, USER, *argv)


def _denied(result: subprocess.CompletedProcess[str]) -> bool:
    """systemd's polkit refusal, not some other failure (a missing user, a crashed tool)."""
    text = result.stderr.lower()
    return result.returncode != 0 and ("access denied" in text or "authentication" in text)


def _stop_unit(box: Container, unit: str) -> subprocess.CompletedProcess[str]:
    """The daemon's own call: Manager.StopUnit(unit, "replace") on the system bus."""
    return _as_supervisor(
        box,
        "busctl",
        "call",
        "org.freedesktop.systemd1",
        "/org/freedesktop/systemd1",
        "org.freedesktop.systemd1.Manager",
        "StopUnit",
        "ss",
        unit,
        "replace",
    )


def _active(box: Container, unit: str) -> str:
    return box.show(unit, "ActiveState")["ActiveState"]


class TestPolkitRule:
    """What the vllm-supervisor user may do to units through systemd's D-Bus API."""

    def test_stop_unit_of_the_configured_unit_is_allowed(self, box: Container) -> None:
        """StopUnit("vllm.service") as vllm-supervisor succeeds and the unit goes down."""
        result = _stop_unit(box, "vllm.service")
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith('o "/org/freedesktop/systemd1/job/')
        wait_for(
            lambda: _active(box, "vllm.service") in ("inactive", "failed"),
            timeout=30,
            what="vllm.service stopped",
        )

    def test_stop_unit_of_another_unit_is_refused(self, box: Container) -> None:
        """StopUnit("other.service") as vllm-supervisor is denied and the unit keeps running."""
        result = _stop_unit(box, "other.service")
        assert _denied(result), result.stderr
        assert _active(box, "other.service") == "active"

    def test_restart_is_allowed_but_start_is_not(self, box: Container) -> None:
        """The rule grants the verbs stop and restart only: `systemctl start` is refused."""
        restart = _as_supervisor(box, "systemctl", "--no-ask-password", "restart", "vllm.service")
        assert restart.returncode == 0, restart.stderr
        box.systemctl("stop", "vllm.service")
        start = _as_supervisor(box, "systemctl", "--no-ask-password", "start", "vllm.service")
        assert _denied(start), start.stderr
        assert _active(box, "vllm.service") in ("inactive", "failed")
        other = _as_supervisor(box, "systemctl", "--no-ask-password", "stop", "other.service")
        assert _denied(other), other.stderr
        assert _active(box, "other.service") == "active"

    def test_root_is_not_what_made_it_work(self, box: Container) -> None:
        """Control: another unprivileged user cannot stop vllm.service (the rule is by user)."""
        stop = ("systemctl", "--no-ask-password", "stop", "vllm.service")
        result = _as_user(box, "nobody", *stop, group="nogroup")
        assert _denied(result), result.stderr
        assert _active(box, "vllm.service") == "active"
