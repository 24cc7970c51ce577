"""The supervisor's own log in a real journal (systemd 252 in systemd-nspawn).

Before, every line was JSON text on stderr at the unit's one priority: `journalctl -u
vllm-supervisor -p warning` showed nothing even for a halt, and no MESSAGE_ID named it. Now a
halt is a warning with its MESSAGE_ID and the unit, invocation and signature as fields, and
`journalctl -x` explains it from the shipped catalog.
"""

from __future__ import annotations

import pytest
from nspawn import Container, wait_for
from served import (
    SEED_LOG,
    UNIT,
    container,
    install_catalog,
    quarantined,
    settled,
    start_supervisor,
)
from test_trust_e2e import CONFIG, FAKE, install

from vllm_supervisor.telemetry.journald import MESSAGE_IDS

pytestmark = pytest.mark.nspawn
__all__ = ["container"]  # the fixture, used by name

HALT = MESSAGE_IDS["unit_halted"]


def test_a_halt_is_a_warning_with_its_id_fields_and_explanation(container: Container) -> None:
    """`-p warning` shows the halt; MESSAGE_ID, SUPERVISED_UNIT and SIGNATURE match it; `-x`
    prints the catalog's words with the unit filled in."""
    install_catalog(container)
    install(container, f"{FAKE} --log {SEED_LOG}", sec="100ms")
    start_supervisor(container, CONFIG.format(extra=""))
    container.systemctl("start", "--no-block", UNIT)
    wait_for(lambda: (quarantined(container) and settled(container)) or None, timeout=40,
             what="the served unit halted")  # fmt: skip
    warnings = container.journal("-u", "vllm-supervisor.service", "-p", "warning")

    def halts() -> list[dict[str, str]]:
        entries = container.journal("-u", "vllm-supervisor.service", "-p", "warning")
        return [e for e in entries if e.get("MESSAGE_ID") == HALT]

    wait_for(lambda: halts() or None, timeout=20, what="the halt in the journal")
    (halt,) = halts()
    assert halt["PRIORITY"] == "4"
    assert (halt["SUPERVISED_UNIT"], halt["SIGNATURE"]) == (UNIT, "flashinfer_cubin_mismatch")
    assert halt["SUPERVISED_INVOCATION_ID"] and halt["SEVERITY"] == "fatal"
    assert all(int(e["PRIORITY"]) <= 4 for e in warnings)
    assert not [e for e in warnings if e.get("EVENT") == "following_journal"]  # info stays out
    explained = container.run(
        "journalctl", "--no-pager", "-x", "-u", "vllm-supervisor.service", f"MESSAGE_ID={HALT}"
    ).stdout
    assert f"{UNIT} was halted after a crash that a restart would repeat" in explained
    assert f"vllm-supervisor release {UNIT}" in explained
