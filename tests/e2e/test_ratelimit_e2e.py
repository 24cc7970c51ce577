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

import pytest
from nspawn import Container, wait_for
from served import (
    QUARANTINE,
    SEED_LOG,
    UNIT,
    container,
    install_served_unit,
    invocations_that_ran,
    quarantined,
    settled,
    start_supervisor,
)

pytestmark = pytest.mark.nspawn
__all__ = ["container"]  # the fixture, used by name

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
