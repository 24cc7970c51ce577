"""Bad configuration of every kind: exit 2 with one line on stderr, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BASE = '[systemd]\nenabled = false\n[[unit]]\nname = "vllm.service"\n'
SIG = """[[signature]]
id = "{id}"
title = "A test signature"
kind = "noise"
patterns = ['{pattern}']
"""

CASES = {
    "unknown key": ("[journal]\nfollow_harder = true\n", None),
    "wrong type": ('[slack]\ntimeout_s = "ten"\n', None),
    "bad unit name": ('[[unit]]\nname = "not a unit"\n', None),
    # systemd's limit (UNIT_NAME_MAX); the reader child refuses a name past 4 KiB on its stdin.
    "unit name too long": (f'[[unit]]\nname = "{"a" * 300}.service"\n', None),
    "not TOML": ("[journal\n", None),
    "bad regex": ("", [SIG.format(id="bad_re", pattern="(unclosed")]),
    "duplicate id": (
        "",
        [SIG.format(id="twice", pattern="boom"), SIG.format(id="twice", pattern="bang")],
    ),
}

# What the one line must name, so the test cannot pass on an unrelated error.
WHAT = {
    "unknown key": "journal.follow_harder: unknown key",
    "wrong type": "slack.timeout_s: expected a number",
    "bad unit name": "is not a systemd unit name",
    "unit name too long": "longer than systemd's 255 characters",
    "not TOML": "not valid TOML",
    "bad regex": "bad_re",
    "duplicate id": "twice",
}


def _write(tmp_path: Path, name: str) -> Path:
    extra, signatures = CASES[name]
    text = extra + (BASE if "unit" not in extra else BASE.split("[[unit]]")[0])
    if signatures is not None:
        sig = tmp_path / "sigs.toml"
        sig.write_text("".join(signatures), encoding="utf-8")
        text = f'[signatures]\npaths = ["{sig}"]\n' + text
    path = tmp_path / "config.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("command", ["check-config", "run"])
def test_bad_config_exits_2_with_one_line(tmp_path: Path, name: str, command: str) -> None:
    """Each kind of mistake is named on one stderr line; exit status 2; no traceback."""
    path = _write(tmp_path, name)
    argv = (
        ["check-config", str(path)] if command == "check-config" else ["run", "--config", str(path)]
    )
    result = subprocess.run(
        [sys.executable, "-m", "vllm_supervisor", *argv, "--state-dir", str(tmp_path / "s")]
        if command == "run"
        else [sys.executable, "-m", "vllm_supervisor", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert lines[0].startswith("vllm-supervisor: ")
    assert WHAT[name] in lines[0]
