"""End to end under systemd 252: a GPU that fell off the bus halts the unit until the host reboots.

The kernel's `NVRM: Xid (PCI:...): 79` line is written into the container's journal with the
kernel's own transport and facility (systemd-journal-remote into the machine's journal
directory, as journald would store the driver's line), then the served unit dies with CUDA's
`unspecified launch failure`. The shipped supervisor joins the two, halts at the first crash and
keeps the record on disk (`persistent_quarantine`, the state directory bound from outside as a
disk outlives a reboot). A start in the same boot is refused. The container then reboots (a new
boot id); the gate finds the halt's boot gone, lifts it, and the unit serves again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from nspawn import Container, wait_for
from served import (
    SUPERVISOR_CONFIG,
    UNIT,
    condition_skips,
    deployed_container,
    install_served_unit,
    invocations_that_ran,
    settled,
    start_supervisor,
    unit_lines,
)

from vllm_supervisor.journal.writer import EntryFactory

pytestmark = pytest.mark.nspawn

STATE = "/var/lib/vllm-supervisor"
RECORD = f"{STATE}/quarantine/{UNIT}.json"
CONFIG = SUPERVISOR_CONFIG + "[state]\npersistent_quarantine = true\n"
LAUNCH_FAILURE_LOG = "/opt/vsup/e2e/gpu-launch-failure.log"
XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4200, name=python3, GPU has fallen off the bus."
SERVING_UNIT = """[Unit]
Description=fake inference server that serves (the GPU is back after the reboot)
StartLimitIntervalSec=0

[Service]
ExecStart=/opt/vsup/e2e/fake-flaky-server.sh /opt/vsup/e2e/unknown-crash.log /run/starts 0
Restart=always
"""


def boot_id(box: Container) -> str:
    return box.run("cat", "/proc/sys/kernel/random/boot_id").stdout.strip().replace("-", "")


def write_kernel_line(box: Container, text: str) -> None:
    """`text` as the kernel's own entry of this boot and machine, in the machine's journal."""
    # Beside journald's own file of this machine (under /var/log or /run/log, by its storage).
    header = box.run("journalctl", "--header", "-n", "0").stdout
    (system,) = [
        line.split(":", 1)[1].strip()
        for line in header.splitlines()
        if line.startswith("File path:") and line.endswith("/system.journal")
    ]
    machine = Path(system).parent.name
    host = box.run("hostname").stdout.strip()
    factory = EntryFactory(boot_id=boot_id(box), machine_id=machine, hostname=host)
    entry = factory.entry(
        {
            "_TRANSPORT": "kernel",
            "SYSLOG_FACILITY": 0,
            "SYSLOG_IDENTIFIER": "kernel",
            "PRIORITY": 4,
            "MESSAGE": text,
        },
        now_us=int(time.time() * 1e6),
    )
    box.write_file("/run/xid.export", entry.decode("utf-8"))
    journal = str(Path(system).parent / "kernel-xid.journal")
    box.run("/lib/systemd/systemd-journal-remote", f"--output={journal}", "/run/xid.export")
    # The daemon reads the journal as a member of systemd-journal, as journald's own files.
    box.run("chgrp", "systemd-journal", journal)
    box.run("chmod", "0640", journal)


def record(box: Container) -> dict[str, Any] | None:
    found = box.run("cat", RECORD, check=False)
    return json.loads(found.stdout) if found.returncode == 0 else None


def test_a_gpu_halt_lasts_the_boot_and_lifts_after_a_reboot(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    disk = [(state, STATE)]
    (tmp_path / "boot1").mkdir()
    with deployed_container(tmp_path / "boot1", writable=disk) as box:
        install_served_unit(box, LAUNCH_FAILURE_LOG, "100ms")
        start_supervisor(box, CONFIG)
        write_kernel_line(box, XID_79)
        box.systemctl("start", "--no-block", UNIT)
        halted = wait_for(
            lambda: (r := record(box)) is not None and r, timeout=60, what="the GPU halt"
        )
        wait_for(lambda: settled(box), timeout=30, what="the unit to stay down")
        assert halted["rule"] == "gpu_xid", halted
        assert halted["evidence"]["kind"] == "gpu_xid" and halted["evidence"]["xid"] == "79"
        assert halted["evidence"]["boot_id"] == boot_id(box)
        assert halted["root_cause"].startswith("NVRM: Xid (PCI:0000:3b:00): 79")
        assert len(invocations_that_ran(box)) == 1  # halted at the first crash
        skipped = condition_skips(box)
        box.systemctl("start", UNIT, check=False)  # the same boot: refused
        wait_for(lambda: condition_skips(box) > skipped, timeout=30, what="the start refused")
        first_boot = boot_id(box)
    (tmp_path / "boot2").mkdir()
    with deployed_container(tmp_path / "boot2", writable=disk) as box:
        assert boot_id(box) != first_boot
        box.write_file(f"/etc/systemd/system/{UNIT}", SERVING_UNIT)
        box.systemctl("daemon-reload")
        start_supervisor(box, CONFIG)
        box.systemctl("start", "--no-block", UNIT)

        def serving() -> bool:
            return any("Avg prompt throughput" in str(e.get("MESSAGE")) for e in unit_lines(box))

        wait_for(serving, timeout=60, what="the unit serving after the reboot")
        assert box.show(UNIT, "ActiveState")["ActiveState"] == "active"
        said = [str(e.get("MESSAGE")) for e in unit_lines(box)]
        assert any("the host rebooted since GPU 0000:3b:00's Xid 79" in line for line in said), said
        assert record(box) is None  # the lift removed the record from the disk
