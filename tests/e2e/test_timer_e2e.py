"""A unit that nothing restarts, started again and again by a timer (systemd 252 in nspawn).

Seen before on this systemd: a `Restart=no` unit started every 15 s by a timer crashed fatally
at each start; every crash was "halt -> down" without a quarantine record ("nothing to halt"),
so 22 starts ran, 22 Slack messages went out and `status` said "ok". A fatal crash of such a
unit is now quarantined too: the gate skips the timer's next starts, and it is told once.
"""

from __future__ import annotations

import json

import pytest
from nspawn import Container, wait_for
from served import (
    QUARANTINE,
    SEED_LOG,
    UNIT,
    condition_skips,
    container,
    history,
    invocations_that_ran,
    quarantined,
    start_supervisor,
)

pytestmark = pytest.mark.nspawn
__all__ = ["container"]  # the fixture, used by name

ONE_SHOT_UNIT = f"""[Unit]
Description=fake inference server that a timer starts; nothing restarts it
StartLimitIntervalSec=0

[Service]
ExecStart=/opt/vsup/e2e/fake-server.sh {SEED_LOG}
"""
TIMER = """[Unit]
Description=starts the fake server again 2 s after each run

[Timer]
OnActiveSec=1s
OnUnitInactiveSec=2s
AccuracySec=100ms
"""


def test_a_fatal_crash_of_a_timer_started_unit_is_quarantined_and_told_once(
    container: Container,
) -> None:
    container.write_file(f"/etc/systemd/system/{UNIT}", ONE_SHOT_UNIT)
    container.write_file("/etc/systemd/system/vllm.timer", TIMER)
    container.systemctl("daemon-reload")
    start_supervisor(container)
    container.systemctl("start", "vllm.timer")

    wait_for(lambda: quarantined(container), timeout=30, what="the quarantine record")
    wait_for(lambda: condition_skips(container) >= 2, timeout=30, what="two starts skipped")
    assert len(invocations_that_ran(container)) == 1
    record = json.loads(container.run("cat", QUARANTINE).stdout)
    assert record["signature"] == "flashinfer_cubin_mismatch"
    crashes = [i for i in history(container) if i["ending"] == "exited"]
    assert [(i["decision"]["action"], i["taken"]) for i in crashes] == [("halt", "halted")]
    status = container.run("vllm-supervisor", "status", UNIT, check=False)
    assert "quarantined" in status.stdout.lower() or "halted" in status.stdout.lower(), status
