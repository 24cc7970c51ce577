"""The command line as an operator runs it: exit codes and one-line errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vllm_supervisor.actions.quarantine import Quarantine


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vllm_supervisor", *args], capture_output=True, text=True, timeout=60
    )


def test_gate_and_release_through_the_cli(tmp_path: Path) -> None:
    """gate exits 1 while quarantined, release lifts it, then gate exits 0."""
    dirs = ["--runtime-dir", str(tmp_path / "run"), "--state-dir", str(tmp_path / "state")]
    Quarantine(tmp_path / "run" / "quarantine").write(
        "vllm.service", {"signature": "flashinfer_cubin_mismatch", "reason": "test"}
    )
    assert _cli("gate", "vllm.service", *dirs).returncode == 1
    released = _cli("release", "vllm.service", *dirs)
    assert released.returncode == 0, released.stderr
    assert "flashinfer_cubin_mismatch" in released.stdout + released.stderr
    assert _cli("gate", "vllm.service", *dirs).returncode == 0


def test_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """An unknown key stops check-config with exit 2 and one line naming the key."""
    path = tmp_path / "bad.toml"
    path.write_text("[journal]\nstartat = 'tail'\n")
    result = _cli("check-config", str(path))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "journal.startat: unknown key" in result.stderr


def test_run_without_a_unit_says_how_to_give_one() -> None:
    """run with nothing to supervise exits 2 and names the flag."""
    result = _cli("run", "--state-dir", "/nonexistent/x", "--runtime-dir", "/nonexistent/y")
    assert result.returncode == 2
    assert "--unit" in result.stderr


def test_shipped_config_checks() -> None:
    """The shipped config and signature table validate."""
    config = Path(__file__).resolve().parents[1] / "config" / "supervisor.toml"
    result = _cli("check-config", str(config))
    assert result.returncode == 0, result.stderr
    assert "signatures" in result.stdout


def test_unknown_signature_set_is_caught_at_load(tmp_path: Path) -> None:
    """A unit naming a signature set that does not exist fails check-config, not a later crash."""
    path = tmp_path / "sets.toml"
    path.write_text("[[unit]]\nname = 'vllm.service'\nsignature_sets = ['vllm', 'nope']\n")
    result = _cli("check-config", str(path))
    assert result.returncode == 2
    assert "unit[0].signature_sets" in result.stderr


@pytest.mark.parametrize(("mode", "warned"), [(0o644, True), (0o600, False)])
def test_check_config_warns_of_an_inline_webhook_every_account_can_read(
    tmp_path: Path, mode: int, warned: bool
) -> None:
    """setup warned; check-config (a reload's check) passed it silently."""
    path = tmp_path / "supervisor.toml"
    path.write_text('[slack]\nwebhook_url = "https://hooks.slack.com/services/T/B/secret"\n')
    path.chmod(mode)
    result = _cli("check-config", str(path))
    assert result.returncode == 0, result.stderr
    assert (
        "readable by every account and holds slack.webhook_url inline" in result.stderr
    ) is warned
    assert "secret" not in result.stderr + result.stdout
