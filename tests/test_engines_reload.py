"""An engine's log format is one data file: the daemon reads it at SIGHUP with the signature
table, and keeps the engine files in force when one of them is broken.

Was: an engine's log prefix was a regex in `classify/logline.py` (and its serving and death
lines, paths and port in six other modules): a new engine needed a new release.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import REPO, wait_for
from faults.harness import UNIT, Supervisor, write_config

from vllm_supervisor.journal.writer import JournalWriter, crashed_invocation

ACME = """\
name = "Acme"
packages = ["acme-serve"]

# `ACME ERR RuntimeError: ...`
[[prefix]]
position = "outer"
starts = "letter"
pattern = 'ACME (?P<level>ERR|INF) '
levels = { ERR = "ERROR", INF = "INFO" }
"""


def _acme_crash(serial: int) -> list[dict[str, Any]]:
    lines = [
        "ACME INF loading the model",
        "ACME ERR Traceback (most recent call last):",
        f'ACME ERR   File "/opt/acme/serve{serial}.py", line {serial}, in load',
        "ACME ERR     raise RuntimeError(widget)",
        f"ACME ERR RuntimeError: widget {serial} fell over",
    ]
    return crashed_invocation(
        UNIT, lines, restarts=serial, invocation_id=f"{serial:032x}", pid=5000 + serial
    )


def _root_causes(sup: Supervisor) -> list[str | None]:
    return [e.get("root_cause") for e in sup.events() if e["event"] == "invocation_ended"]


def _events(sup: Supervisor, name: str) -> list[dict[str, Any]]:
    return [e for e in sup.events() if e["event"] == name]


def test_an_engine_file_added_applies_at_a_reload_and_a_broken_one_changes_nothing(
    tmp_path: Path,
) -> None:
    """A broken engine file written and SIGHUP sent: the reload is refused in one line naming
    the file and key, and the next crash is read as before. Fixed and reloaded: the new
    engine's prefix is stripped from the next crash's lines."""
    engines = tmp_path / "engines"
    shutil.copytree(REPO / "config" / "engines", engines)
    sup = Supervisor(
        tmp_path, write_config(tmp_path), env={"VLLM_SUPERVISOR_ENGINES": str(engines)}
    )
    try:
        with JournalWriter(tmp_path / "journal") as writer:
            sup.start()
            wait_for(sup.following, timeout=30, what="the daemon following")
            (engines / "acme.toml").write_text(ACME.replace('"outer"', '"sideways"'))
            sup.process.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
            wait_for(lambda: _events(sup, "config_reload_failed"), timeout=30, what="refusal")
            writer.write(_acme_crash(1))
            wait_for(lambda: len(_root_causes(sup)) == 1, timeout=30, what="crash 1")
            (engines / "acme.toml").write_text(ACME)
            sup.process.send_signal(signal.SIGHUP)  # type: ignore[union-attr]
            wait_for(lambda: _events(sup, "config_reloaded"), timeout=30, what="the reload")
            writer.write(_acme_crash(2))
            wait_for(lambda: len(_root_causes(sup)) == 2, timeout=30, what="crash 2")
    finally:
        sup.stop_quietly()
    [refused] = _events(sup, "config_reload_failed")
    assert refused["error"].startswith(f"{engines / 'acme.toml'}: prefix[0].position: ")
    assert "\n" not in refused["error"]
    first, second = _root_causes(sup)
    assert first != "RuntimeError: widget 1 fell over"  # the prefix was not known yet
    assert second == "RuntimeError: widget 2 fell over"


def test_check_config_refuses_a_broken_engine_file_in_one_line(tmp_path: Path) -> None:
    """check-config is the shipped unit's ExecReload=: a broken engine file fails it visibly,
    before the daemon is sent SIGHUP; a good one is named."""
    engines = tmp_path / "engines"
    shutil.copytree(REPO / "config" / "engines", engines)
    config = write_config(tmp_path)

    def check() -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "vllm_supervisor", "check-config", str(config)]
        env = {"VLLM_SUPERVISOR_ENGINES": str(engines), "PATH": "/usr/bin:/bin"}
        return subprocess.run(argv, capture_output=True, text=True, env=env, check=False)

    (engines / "acme.toml").write_text(ACME)
    good = check()
    assert good.returncode == 0, good.stderr
    shipped = "llamacpp, lmdeploy, ollama, sglang, tgi, tritonserver, vllm"
    assert f"engines: acme, {shipped}" in good.stdout
    (engines / "acme.toml").write_text(ACME.replace("ERR|INF", "ERR|INF("))
    bad = check()
    assert bad.returncode == 2
    # The line names the engine file at fault, not the config that did not mention it.
    assert bad.stderr.strip().splitlines() == [
        f"vllm-supervisor: {engines / 'acme.toml'}: prefix[0].pattern: invalid regex: "
        "missing ), unterminated subpattern at position 5"
    ]
