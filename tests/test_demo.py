"""The README's first command: `vllm-supervisor demo` shows every feature on a real journal."""

from __future__ import annotations

import subprocess
import sys

from vllm_supervisor.story import told


def test_demo_shows_the_halt_drift_hang_preflight_and_triage() -> None:
    """One run: the crash loop halted with its drift named, a hung engine, preflight failing."""
    done = subprocess.run(
        [sys.executable, "-m", "vllm_supervisor", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.count(": fatal flashinfer_cubin_mismatch\n") == 3  # history
    # One story per event: history and Slack say the hung engine in the same words.
    assert out.count(told("allow-restart", "down")) == 2, out
    drift = "changed since the last good start: flashinfer-python 0.6.3 → 0.6.4"
    assert out.count(drift) >= 2, out  # history and preflight name it
    assert (
        "changed:     since the last good start: flashinfer-python 0.6.3 → 0.6.4" in out
    )  # triage
    assert "vllm-chat.service cccccccccccccccccccccccccccccccc: transient nccl_timeout" in out
    assert "(engine hung)" in out
    assert "Engine hung:" in out  # the Slack message
    # One story per crash loop: one halt, one message; the loop's later crashes join it.
    assert out.count("the same loop: already halted by") == 2
    assert "== Slack: 2 messages" in out  # the loop's halt and the hung engine
    assert out.count(f"Action: {told('halt', 'quarantined')} (after 1 crash in a row)") == 1
    assert "Log: journalctl -u vllm.service _SYSTEMD_INVOCATION_ID=" in out
    # Between its sections only the daemon's warnings, as readable lines, never JSON.
    assert (out + done.stderr).count("unit_halted") == 1
    assert not [line for line in (out + done.stderr).splitlines() if line.startswith("{")]
    assert "exit status 1: systemd would skip the next start" in out
    assert out.count("FAIL flashinfer_cubin_mismatch") == 1  # the packages and the quarantine
    assert "release UNIT" not in out
    assert "None" not in out
    assert "crash site:  File" in out  # triage separates the crash site from the root cause
    # The webhook's secret path stays out of everything the demo prints or logs.
    assert "demo-secret" not in out + done.stderr
