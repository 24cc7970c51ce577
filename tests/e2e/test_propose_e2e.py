"""An unknown crash loop becomes a first-crash halt in one command and a reload (systemd 252).

The crash is a real log's (corpus 149: flashinfer's prefill kernel failing at the first
request after every start), printed after the server's serving lines, by a daemon whose table
lacks the flashinfer signatures: to it the crash is new. The loop is halted only after it
repeats; `signatures propose --write` turns the record into a signature in
`/etc/vllm-supervisor/signatures.d/`, `systemctl reload` applies it, and the next start of the
same crash is halted at its first crash.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from nspawn import Container, wait_for
from served import (
    FAST_PACED_CONFIG,
    REPO,
    UNIT,
    container,
    history,
    install_served_unit,
    invocations_that_ran,
    quarantined,
    settled,
    start_supervisor,
    supervisor_events,
)

pytestmark = pytest.mark.nspawn
__all__ = ["container"]  # the fixture, used by name

TABLE = "/etc/vllm-supervisor/table"
SHIPPED = "/opt/vsup/src/config/signatures"
LOG = "/run/real-crash.log"
DATA = REPO / "tests" / "data"
REAL = DATA / "corpus" / "149-flashinfer-prefill-invalid-resource-handle-first-request-sm121.log"
SERVING = DATA / "requests" / "serving.txt"
CONFIG = FAST_PACED_CONFIG.replace("[metrics]", f'[signatures]\npaths = ["{TABLE}"]\n\n[metrics]')


def _blind_table(box: Container) -> None:
    """The shipped table without flashinfer.toml: the crash is unknown to the daemon."""
    box.run("mkdir", "-p", TABLE)
    box.run("sh", "-c", f"cp {SHIPPED}/*.toml {TABLE}/ && rm {TABLE}/flashinfer.toml")


def test_a_proposed_signature_halts_the_loops_next_start_at_its_first_crash(
    container: Container,
) -> None:
    log = SERVING.read_text() + Path(REAL).read_text()
    container.write_file(LOG, log)
    _blind_table(container)
    install_served_unit(container, LOG, "100ms")
    start_supervisor(container, CONFIG)
    container.systemctl("start", "--no-block", UNIT)
    wait_for(lambda: quarantined(container), timeout=90, what="the unknown loop halted")
    wait_for(lambda: settled(container), timeout=30, what="the unit to stay down")
    looped = len(invocations_that_ran(container))
    assert looped >= 2, "an unknown crash is halted only once it repeats"
    assert all(i["verdict"]["signature"] is None for i in history(container))

    done = container.run("vllm-supervisor", "signatures", "propose", UNIT, "--write")
    assert "wrote signature local_internalerror_" in done.stdout, done.stdout + done.stderr
    proposed = container.run("cat", "/etc/vllm-supervisor/signatures.d/proposed.toml").stdout
    assert "BatchPrefillWithPagedKVCache" in proposed and "invocation = " in proposed
    container.systemctl("reload", "vllm-supervisor.service")
    wait_for(lambda: supervisor_events(container, "config_reloaded") or None, timeout=30,
             what="the reload")  # fmt: skip

    container.run("vllm-supervisor", "release", UNIT)
    container.systemctl("start", "--no-block", UNIT)
    wait_for(lambda: quarantined(container), timeout=60, what="the halt of the next start")
    wait_for(lambda: settled(container), timeout=30, what="the unit to stay down")
    assert len(invocations_that_ran(container)) == looped + 1  # halted at its first crash
    last = next(i for i in reversed(history(container)) if i["decision"]["action"] == "halt")
    assert (last["verdict"]["signature"] or "").startswith("local_internalerror_"), [
        (i["decision"]["rule"], i["verdict"]["signature"], i["taken"]) for i in history(container)
    ]
    assert (last["decision"]["action"], last["taken"]) == ("halt", "halted")
