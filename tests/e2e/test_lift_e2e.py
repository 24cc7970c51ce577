"""End to end under systemd 252: a halt lasts until the unit's config changes, no longer.

The shipped supervisor halts the fake served unit on the seed flashinfer crash; the record keeps
what the unit ran with, read by the daemon in its sandbox (D-Bus, the unit's files). Unchanged,
the next `systemctl start` is skipped by the gate. An edited EnvironmentFile=, then an
ExecStart= changed by a drop-in and `daemon-reload`, each let the next start run with no
`release`, and the gate's one line in the unit's journal says what changed.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from nspawn import Container, wait_for
from served import (
    QUARANTINE,
    SEED_LOG,
    UNIT,
    condition_skips,
    container,
    install_served_unit,
    invocations_that_ran,
    quarantined,
    settled,
    start_supervisor,
    unit_lines,
)

pytestmark = pytest.mark.nspawn
__all__ = ["container"]  # the fixture, used by name

ENV_FILE = "/etc/default/vllm"
ENV_DROP_IN = f"/etc/systemd/system/{UNIT}.d/60-environment.conf"
EXEC_DROP_IN = f"/etc/systemd/system/{UNIT}.d/70-exec-start.conf"


def record(box: Container) -> dict[str, Any] | None:
    """The quarantine record once the daemon added the environment to it (after the stop)."""
    done = box.run("cat", QUARANTINE, check=False)
    if done.returncode != 0:
        return None
    found = json.loads(done.stdout)
    return found if isinstance(found, dict) and found.get("environment") else None


def halted(box: Container, after: str | None = None) -> dict[str, Any]:
    """Wait for a halt (of another invocation than `after`) and the unit to stay down."""
    found = wait_for(
        lambda: (r := record(box)) is not None and r.get("invocation_id") != after and r,
        timeout=30,
        what="the quarantine record with its environment",
    )
    wait_for(lambda: settled(box), timeout=30, what="the served unit to stay down")
    return dict(found)


def lifted(box: Container) -> list[str]:
    """The gate's lines that let a start through because something changed."""
    return [
        str(e.get("MESSAGE")) for e in unit_lines(box) if "halt is lifted" in str(e.get("MESSAGE"))
    ]


def test_a_halted_unit_starts_again_once_its_config_changes(container: Container) -> None:
    box = container
    box.write_file(ENV_FILE, "VLLM_USE_FLASHINFER_SAMPLER=1\n")
    box.write_file(ENV_DROP_IN, f"[Service]\nEnvironmentFile=-{ENV_FILE}\n")
    install_served_unit(box, SEED_LOG, "100ms")
    start_supervisor(box)
    box.systemctl("start", "--no-block", UNIT)
    first = halted(box)
    kept = first["environment"]
    digest = hashlib.sha256(b"VLLM_USE_FLASHINFER_SAMPLER=1\n").hexdigest()
    assert kept["environment_files"] == {ENV_FILE: digest}
    assert ENV_DROP_IN in kept["unit_files"] and "exec_start" in kept
    ran = len(invocations_that_ran(box))

    # Nothing changed: the start is skipped, the record stays.
    skips = condition_skips(box)
    box.systemctl("start", UNIT, check=False)
    wait_for(lambda: condition_skips(box) > skips, timeout=20, what="the start skipped")
    assert len(invocations_that_ran(box)) == ran and quarantined(box) and lifted(box) == []

    # The environment file edited: the next start runs, and halts again on the same crash.
    box.write_file(ENV_FILE, "VLLM_USE_FLASHINFER_SAMPLER=0\n")
    box.systemctl("start", "--no-block", UNIT)
    second = halted(box, after=first["invocation_id"])
    assert len(invocations_that_ran(box)) == ran + 1
    [line] = lifted(box)
    assert f"start allowed: the halt is lifted, {ENV_FILE} changed since the halt" in line

    # ExecStart= changed by a drop-in, loaded by daemon-reload: the next start runs too.
    box.write_file(
        EXEC_DROP_IN,
        f"[Service]\nExecStart=\nExecStart=/opt/vsup/e2e/fake-server.sh {SEED_LOG} 1\n",
    )
    box.systemctl("daemon-reload")
    box.systemctl("start", "--no-block", UNIT)
    halted(box, after=second["invocation_id"])
    assert len(invocations_that_ran(box)) == ran + 2
    line = lifted(box)[-1]
    assert "ExecStart= changed" in line and f"unit file {EXEC_DROP_IN} added" in line
