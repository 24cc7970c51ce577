"""Whether systemd runs the gate is asked of systemd, not of the files (systemd 252 in nspawn).

Seen on this systemd: a `systemctl edit` drop-in holding `ExecCondition=` (empty, to add a
condition of its own) took the gate away, and nothing said so: the daemon halted the next fatal
crash, and a person's start ran it again, one wasted start; and `check-config` warned about a
unit whose gate was written in its unit file itself (no drop-in file to find). Now both ask
systemd for the unit's loaded ExecCondition=: the emptied gate is warned about by the daemon at
its start and by `check-config`; the gate in the unit file is not.
"""

from __future__ import annotations

import pytest
from nspawn import Container, wait_for
from served import UNIT, container, start_supervisor, supervisor_events

pytestmark = pytest.mark.nspawn
__all__ = ["container"]  # the fixture, used by name

INLINE = "vllm-inline.service"
GATE = (
    "ExecCondition=+/usr/local/bin/vllm-supervisor gate --runtime-dir /run/vllm-supervisor "
    "--state-dir /var/lib/vllm-supervisor %n"
)
CONFIG = f"""[[unit]]
name = "{UNIT}"

[[unit]]
name = "{INLINE}"

[metrics]
enabled = false
"""


def test_an_emptied_gate_is_warned_about_and_one_in_the_unit_file_is_not(
    container: Container,
) -> None:
    container.write_file(f"/etc/systemd/system/{UNIT}", "[Service]\nExecStart=/bin/true\n")
    # The shipped drop-in (10-) gates vllm.service; an edit sorted after it empties the list.
    container.write_file(
        f"/etc/systemd/system/{UNIT}.d/override.conf", "[Service]\nExecCondition=\n"
    )
    container.write_file(
        f"/etc/systemd/system/{INLINE}", f"[Service]\n{GATE}\nExecStart=/bin/true\n"
    )
    container.systemctl("daemon-reload")
    assert "vllm-supervisor" not in container.show(UNIT, "ExecCondition").get("ExecCondition", "")
    start_supervisor(container, CONFIG)
    warned = wait_for(
        lambda: supervisor_events(container, "unit_not_gated") or None,
        timeout=30,
        what="the daemon's warning",
    )
    assert [event["unit"] for event in warned] == [UNIT]
    checked = container.run(
        "vllm-supervisor", "check-config", "/etc/vllm-supervisor/supervisor.toml", check=False
    )
    assert checked.returncode == 0, checked.stderr
    assert f"systemd runs no vllm-supervisor gate for {UNIT} " in checked.stderr
    assert INLINE not in checked.stderr, checked.stderr
