"""A server that exits under `RemainAfterExit=yes` is not left for dead (systemd 252 in nspawn).

Seen before on this systemd: a unit with `RemainAfterExit=yes` whose server printed an NCCL
crash and exited 0 stayed "active (exited)": PID 1 logs a clean exit only at debug level, so
nothing ended the run in the journal, nothing decided about it and nothing said the server was
gone. systemd's own state (PropertiesChanged to active/exited, no main process) now ends the
run; it is decided like any other, and a transient crash is restarted by the supervisor, as
systemd will not restart a unit that it sees as active.
"""

from __future__ import annotations

import pytest
from nspawn import Container, wait_for
from served import (
    NCCL_LOG,
    UNIT,
    container,
    history,
    invocations_that_ran,
    start_supervisor,
)

pytestmark = pytest.mark.nspawn
__all__ = ["container"]  # the fixture, used by name

REMAINING_UNIT = f"""[Unit]
Description=fake inference server that exits 0 after an NCCL crash, RemainAfterExit=yes
StartLimitIntervalSec=0

[Service]
ExecStart=/opt/vsup/e2e/fake-server.sh {NCCL_LOG} 0
RemainAfterExit=yes
Restart=always
"""


def test_a_server_gone_under_remain_after_exit_is_decided_and_restarted(
    container: Container,
) -> None:
    container.write_file(f"/etc/systemd/system/{UNIT}", REMAINING_UNIT)
    container.systemctl("daemon-reload")
    start_supervisor(container)
    container.systemctl("start", "--no-block", UNIT)

    wait_for(lambda: history(container) or None, timeout=30, what="the run decided")
    (first, *_) = history(container)
    assert first["verdict"]["signature"] == "nccl_timeout", first["verdict"]
    assert (first["decision"]["action"], first["taken"]) == ("allow-restart", "restarted")
    wait_for(lambda: len(invocations_that_ran(container)) >= 2, timeout=30, what="a restart")
