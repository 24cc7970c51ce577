"""A version that grows with each build, shown by `--version` and by `status` (issue 37, 6).

Seen before: every build was 0.1.0, so `pip install` of a newer wheel over an older one did
nothing without `--force-reinstall`, and nobody could tell which build a daemon ran. Now the
version is SERIES.N, N the commits in the git history (setup.py), and `status` shows the
running daemon's (its build_info) beside the installed one when they differ.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from packaging.version import Version

from vllm_supervisor import __version__
from vllm_supervisor.commands.status import DaemonStatus, Status, render_text, version_in
from vllm_supervisor.telemetry.metrics import Metrics, new_registry

REPO = Path(__file__).resolve().parent.parent


def _setup_version(env: dict[str, str] | None = None, cwd: Path = REPO) -> str:
    """What setup.py says the version of a build from `cwd` is."""
    done = subprocess.run(
        [sys.executable, str(REPO / "setup.py"), "--version"],
        capture_output=True,
        text=True,
        check=True,
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        timeout=120,
    )
    return done.stdout.strip().splitlines()[-1]


def test_a_build_from_the_checkout_is_the_series_and_its_commit_count() -> None:
    commits = subprocess.run(
        ["git", "-C", str(REPO), "rev-list", "--count", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    built = _setup_version()
    assert built == f"0.1.{commits}"
    assert Version(built) > Version("0.1.0")  # pip replaces the old fixed 0.1.0 with it


def test_an_environment_given_version_wins_for_a_copy_without_history() -> None:
    assert _setup_version({"VLLM_SUPERVISOR_VERSION": "0.1.4242"}) == "0.1.4242"


def test_the_cli_says_the_installed_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "vllm_supervisor", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == f"vllm-supervisor {__version__}"


def test_status_shows_the_running_version_and_a_newer_installed_one() -> None:
    metrics = Metrics(new_registry(process=False))
    running = version_in(metrics.exposition()[0].decode())
    assert running == __version__
    same = render_text(Status(units=(), daemon=DaemonStatus(running=True, version=running)))
    assert f"version {__version__})" in same and "is installed" not in same
    older = render_text(Status(units=(), daemon=DaemonStatus(running=True, version="0.1.7")))
    assert "version 0.1.7)" in older
    assert f"{__version__} is installed: restart it" in older


@given(st.text() | st.lists(st.sampled_from(["vllm_supervisor_build_info", "{", "}", '"', " ",
                                              'version="', "0.1.9", "1", "\n", "\\", "nan"]))
       .map("".join))  # fmt: skip
def test_any_answer_on_the_metrics_port_reads_as_a_version_or_none(text: str) -> None:
    """Whatever answers on the port: no crash, and a version only of version characters."""
    found = version_in(text)
    assert found is None or (0 < len(found) <= 64 and found.isprintable() and " " not in found)
