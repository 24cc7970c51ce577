"""A fatal crash while the supervisor itself is down halts on the first start (systemd 252).

Seen before on this systemd, `RestartSec=100ms`: the supervisor restarted (`systemctl restart`),
killed (`kill -9`) or frozen (SIGSTOP) at the moment the served unit exited with a fatal crash.
Each start's gate found no daemon and let the start through (a frozen one held the first start
until the gate's own timeout), so the unit was started 2 (restart) to 6 (kill -9) times before
the new daemon read the crashes, all of them by then "read late".

Now the gate asks systemd about the supervisor's own unit when no daemon answers: while systemd
is bringing it back (a start or restart job, `auto-restart`, activating), the gate waits for it,
bounded, and the new daemon decides the crash that ended while it was away.
"""

from __future__ import annotations

import json

import pytest
from nspawn import Container, wait_for
from served import (
    QUARANTINE,
    SEED_LOG,
    UNIT,
    container,
    history,
    install_served_unit,
    invocations_that_ran,
    quarantined,
    settled,
    start_supervisor,
)

pytestmark = pytest.mark.nspawn
__all__ = ["container"]  # the fixture, used by name

SUPERVISOR = "vllm-supervisor.service"
FROZEN = "/run/supervisor-frozen"
# The first run waits until the supervisor is away (its unit activating again, or frozen), then
# crashes; every later run crashes at once, as a deterministic fatal crash does.
RACING_UNIT = """[Unit]
Description=fake inference server that crashes while the supervisor is away
StartLimitIntervalSec=0

[Service]
ExecStart=/bin/sh -c 'if [ ! -e /run/raced ]; then touch /run/raced; \
until [ -e {frozen} ] || [ "$(systemctl show -P ActiveState {supervisor})" = activating ]; \
do sleep 0.02; done; fi; exec /opt/vsup/e2e/fake-server.sh {log}'
Restart=always
"""


def running(box: Container) -> bool:
    state = box.show(UNIT, "ActiveState", "SubState")
    return state["ActiveState"] == "active" and state["SubState"] == "running"


@pytest.mark.parametrize("how", ["restart", "kill -9", "frozen"])
def test_a_fatal_crash_while_the_supervisor_is_away_halts_on_the_first_start(
    container: Container, how: str
) -> None:
    install_served_unit(container, SEED_LOG, "100ms")
    racing = RACING_UNIT.format(supervisor=SUPERVISOR, log=SEED_LOG, frozen=FROZEN)
    container.write_file(f"/etc/systemd/system/{UNIT}", racing)
    container.systemctl("daemon-reload")
    start_supervisor(container)
    container.systemctl("start", "--no-block", UNIT)
    wait_for(lambda: running(container), timeout=30, what="the served unit to run")

    if how == "restart":
        container.systemctl("restart", "--no-block", SUPERVISOR)
    else:
        pid = container.show(SUPERVISOR, "MainPID")["MainPID"]
        container.run("kill", "-KILL" if how == "kill -9" else "-STOP", pid)
        if how == "frozen":
            container.write_file(FROZEN, "")  # WatchdogSec=30s kills it; Restart= brings it back

    wait_for(lambda: quarantined(container), timeout=90, what="the quarantine record")
    wait_for(lambda: settled(container), timeout=30, what="the served unit to stay down")
    ran = invocations_that_ran(container)
    assert len(ran) == 1, f"the server ran {len(ran)} times: every start after the crash wasted"
    record = json.loads(container.run("cat", QUARANTINE).stdout)
    assert record["signature"] == "flashinfer_cubin_mismatch"
    decided = [i for i in history(container) if i["ending"] == "exited"]
    assert [(i["decision"]["action"], i["taken"]) for i in decided] == [("halt", "halted")]
    gate_lines = [
        str(e.get("MESSAGE"))
        for e in container.journal("-u", UNIT)
        if "waiting for the supervisor" in str(e.get("MESSAGE"))
    ]
    # After a kill the supervisor is away for RestartSec=2s at least: the gate found no daemon
    # and said it waits. A `systemctl restart` can be back (its socket listening) before the
    # unit's restart runs its gate, which then simply asks it.
    if how != "restart":
        assert len(gate_lines) == 1, "the gate must say once that it waits for the supervisor"
