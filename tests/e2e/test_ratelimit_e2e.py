"""A flood of lines before a fatal crash does not cost the crash its lines (systemd 252).

Seen before on this systemd: a served unit that printed a flood (a warning per request, a
retry loop) just before a fatal crash lost the crash's own lines to journald's rate limit
(`RateLimitBurst=10000` per 30 s, scaled by free disk): the crash was "Crash whose log lines
were lost", unknown, and halted on the 3rd start, two model loads wasted. The gate drop-in now
raises the served unit's own limit (`LogRateLimitBurst=`), so the crash's lines reach the
journal and the crash is known and halted at the first.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from nspawn import Container, wait_for
from served import (
    QUARANTINE,
    SEED_LOG,
    SUPERVISOR_CONFIG,
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

BURST = "[tracker]\nratelimit_burst = 20000\n\n"
# More lines than journald's default burst lets through on any disk (10000, times at most
# about 6 on a disk with terabytes free), printed in well under its 30 s interval.
FLOOD_LINES = 120_000
FLOOD = "/run/flood.py"
# One process floods, then crashes: vLLM's engine prints its own traceback last.
FLOOD_SCRIPT = f"""import re, sys
for i in range({FLOOD_LINES}):
    print("WARNING request %d rejected: queue full" % i)
prefix = re.compile(r"^[A-Z][a-z]{{2}} [ 0-9]{{2}} [0-9:]{{8}} [^ ]+ [^ ]+\\[[0-9]+\\]: ")
with open("{SEED_LOG}", encoding="utf-8") as log:
    for line in log:
        print(prefix.sub("", line.rstrip("\\n")))
sys.exit(1)
"""
FLOODING_UNIT = f"""[Unit]
Description=fake inference server that floods its log, then crashes fatally
StartLimitIntervalSec=0

[Service]
ExecStart=/usr/bin/python3 {FLOOD}
Restart=always
"""


def test_a_crash_after_a_flood_keeps_its_lines_and_halts_at_the_first(
    container: Container,
) -> None:
    install_served_unit(container, SEED_LOG, "100ms")
    container.write_file(FLOOD, FLOOD_SCRIPT)
    container.write_file(f"/etc/systemd/system/{UNIT}", FLOODING_UNIT)
    container.systemctl("daemon-reload")
    start_supervisor(container)
    container.systemctl("start", "--no-block", UNIT)

    wait_for(lambda: quarantined(container), timeout=120, what="the quarantine record")
    wait_for(lambda: settled(container), timeout=30, what="the served unit to stay down")
    record = json.loads(container.run("cat", QUARANTINE).stdout)
    assert record["signature"] == "flashinfer_cubin_mismatch", record
    ran = invocations_that_ran(container)
    assert len(ran) == 1, f"the server ran {len(ran)} times: the crash was not known at once"


# The flood: 30k lines/s for 10 s (300k lines), then the seed crash. journald's limit
# for the unit (the drop-in's burst, times up to about 6 with free disk) may or may not let the
# crash through: either the crash is known and halted by the 2nd start, or the verdict says its
# lines may have been lost and the loop is paced.
PACED_FLOOD_SCRIPT = f"""import re, sys, time
for second in range(10):
    began = time.monotonic()
    for i in range(30_000):
        print("WARNING request %d rejected: queue full" % (second * 30_000 + i))
    sys.stdout.flush()
    time.sleep(max(0.0, 1.0 - (time.monotonic() - began)))
prefix = re.compile(r"^[A-Z][a-z]{{2}} [ 0-9]{{2}} [0-9:]{{8}} [^ ]+ [^ ]+\\[[0-9]+\\]: ")
with open("{SEED_LOG}", encoding="utf-8") as log:
    for line in log:
        print(prefix.sub("", line.rstrip("\\n")))
sys.exit(1)
"""


@pytest.mark.parametrize("restart_sec", ["2s", "10s"])
def test_a_flood_past_the_limit_is_halted_early_or_said_and_paced(
    container: Container, restart_sec: str
) -> None:
    install_served_unit(container, SEED_LOG, restart_sec)
    container.write_file(FLOOD, PACED_FLOOD_SCRIPT)
    container.write_file(f"/etc/systemd/system/{UNIT}", FLOODING_UNIT)
    # A smaller burst than the drop-in's stands for a host whose free disk scales it less or a
    # flood larger than this one: the flood spends it, whatever this machine's disk.
    container.write_file(
        f"/etc/systemd/system/{UNIT}.d/60-e2e-burst.conf", "[Service]\nLogRateLimitBurst=20000\n"
    )
    container.systemctl("daemon-reload")
    start_supervisor(container, SUPERVISOR_CONFIG.replace("[metrics]", BURST + "[metrics]"))
    container.systemctl("start", "--no-block", UNIT)

    def decided() -> list[dict[str, Any]] | None:
        seen = history(container)
        return seen if any(i["taken"] in ("halted", "held") for i in seen) else None

    seen = wait_for(decided, timeout=150, what="a halt or a hold")
    first = next(i for i in seen if i["taken"] in ("halted", "held"))  # oldest first
    ran = invocations_that_ran(container)
    if first["taken"] == "halted":
        assert len(ran) <= 2, f"halted after {len(ran)} starts"
        return
    assert len(ran) <= 2, f"paced after {len(ran)} starts"
    # The crash that flooded says its lines may have been dropped; the held one, whose lines
    # journald dropped all (same interval), says so in the reason its hold shows.
    flooded = next(i for i in seen if i["lines"] >= 20_000)
    assert any("may have been dropped by journald" in n for n in flooded["verdict"]["notes"])
    assert "journald" in first["decision"]["reason"], first["decision"]
    status = container.run("vllm-supervisor", "status", UNIT).stdout
    assert "paced" in status and "journald" in status, status
