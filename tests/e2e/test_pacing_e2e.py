"""Every crash loop ends under a real systemd 252 (in systemd-nspawn): halted on evidence, or
paced, and a paced unit comes back by itself.

Seen on this systemd before pacing: a unit that exits 1 after its start-up lines with no error
line restarted about 100 times in 5 minutes at `RestartSec=1s`, and nothing slowed it; the
policy let such a crash restart "however often it repeats". Three units run at once here, each
under `Restart=always`, `RestartSec=1s`: one that exits with no error line, one whose hub answers
429 to its first 3 starts and then serves, and the seed's fatal flashinfer crash. The schedule
is the shipped one scaled down twelvefold (5 s doubling to 40 s instead of 1 min to 1 h) so the
test takes a minute; `python -m bench.pacing` runs the shipped schedule for 5 minutes.
"""

from __future__ import annotations

import itertools
import time

import pytest
from nspawn import Container, wait_for
from served import (
    CONDITION_SKIPPED,
    JOB_STARTED,
    SEED_LOG,
    container,
    history,
    start_supervisor,
)

pytestmark = pytest.mark.nspawn
__all__ = ["container"]  # the fixture, used by name

SILENT = "vllm-silent.service"
FLAKY = "vllm-flaky.service"
FATAL = "vllm.service"
PACE_FIRST_S = 5.0
PACE_MAX_S = 40.0

DROP_IN = """[Service]
ExecCondition=+/usr/local/bin/vllm-supervisor gate --runtime-dir /run/vllm-supervisor \
--state-dir /var/lib/vllm-supervisor %n
RestartSec=1s
"""

UNIT_FILE = """[Unit]
Description=fake inference server for the pacing e2e test
StartLimitIntervalSec=0

[Service]
ExecStart={command}
Restart=always
"""

CONFIG = (
    "".join(
        f'[[unit]]\nname = "{unit}"\npace_first_s = {PACE_FIRST_S}\npace_max_s = {PACE_MAX_S}\n\n'
        for unit in (SILENT, FLAKY, FATAL)
    )
    + '[metrics]\nlisten = "127.0.0.1:9464"\n'
)


def install(box: Container, unit: str, command: str) -> None:
    """The unit with the gate's drop-in (the shipped one is bound in for vllm.service: only its
    RestartSec= is set here)."""
    box.write_file(f"/etc/systemd/system/{unit}", UNIT_FILE.format(command=command))
    if unit == FATAL:
        box.write_file(f"/etc/systemd/system/{unit}.d/50-e2e.conf", "[Service]\nRestartSec=1s\n")
    else:
        box.write_file(f"/etc/systemd/system/{unit}.d/10-vllm-supervisor.conf", DROP_IN)


def starts(box: Container, unit: str) -> list[float]:
    """When PID 1 started a run of `unit` that ran its server (not one the gate skipped)."""
    entries = box.journal("-u", unit)
    skipped = {e.get("INVOCATION_ID") for e in entries if e.get("MESSAGE_ID") == CONDITION_SKIPPED}
    return [
        int(e["__REALTIME_TIMESTAMP"]) / 1e6
        for e in entries
        if e.get("MESSAGE_ID") == JOB_STARTED
        and e.get("UNIT") == unit
        and e.get("INVOCATION_ID") not in skipped
    ]


def serving(box: Container, unit: str) -> bool:
    return any("Avg prompt throughput" in str(e.get("MESSAGE")) for e in box.journal("-u", unit))


def test_three_loops_at_once_end_halted_or_paced_and_come_back(container: Container) -> None:
    install(container, SILENT, "/opt/vsup/e2e/fake-server.sh /opt/vsup/e2e/silent-exit.log 1")
    install(
        container,
        FLAKY,
        "/opt/vsup/e2e/fake-flaky-server.sh /opt/vsup/e2e/hub-429.log /run/e2e-flaky-starts 3",
    )
    install(container, FATAL, f"/opt/vsup/e2e/fake-server.sh {SEED_LOG} 1")
    container.systemctl("daemon-reload")
    start_supervisor(container, CONFIG)
    began = time.time()
    container.systemctl("start", "--no-block", SILENT, FLAKY, FATAL)

    # The flaky unit: 429, 429 (held 5 s), 429 (held 10 s), then it serves, by itself.
    wait_for(lambda: serving(container, FLAKY), timeout=60, what="the flaky unit to serve")
    assert len(starts(container, FLAKY)) == 4, starts(container, FLAKY)

    # The silent unit, a minute on: paced, not restarted every second, and still coming back.
    wait_for(lambda: time.time() - began >= 60, timeout=70, what="a minute", interval=1)
    silent = starts(container, SILENT)
    assert 3 <= len(silent) <= 7, silent  # systemd alone: about 50 at RestartSec=1s
    gaps = [b - a for a, b in itertools.pairwise(silent)]
    assert max(gaps) >= 2 * PACE_FIRST_S, gaps
    assert any(gap >= PACE_FIRST_S for gap in gaps[1:]), gaps  # it came back after a hold

    # The seed's fatal crash ran once: halted on its evidence, never paced.
    assert len(starts(container, FATAL)) == 1, starts(container, FATAL)
    decided = {(o["unit"], o["decision"]["action"]) for o in history(container)}
    assert (FATAL, "halt") in decided, decided
    assert (SILENT, "hold") in decided, decided
    assert (FLAKY, "hold") in decided, decided
