"""A config that names an alias of the served unit supervises the real unit (systemd 252).

Seen before on this systemd: `vllm.service` declares `[Install] Alias=llm.service` and is
enabled; the config names `llm.service`. The journal knows the unit only as `vllm.service`
(its `_SYSTEMD_UNIT`, PID 1's `UNIT=`), so the daemon, following `llm.service`, saw nothing:
3 fatal starts in 100 s, no decision, no warning. The polkit rule `setup` generated named
`llm.service`, and polkit is asked about the unit's real name: every stop would be refused.

Now the daemon asks systemd for the unit's `Id` and `Names`, follows and decides under the
real name, and says so in one line; `setup` gates and permits the real unit.
"""

from __future__ import annotations

import json

import pytest
from nspawn import Container, wait_for
from packaged import Built
from served import (
    QUARANTINE,
    SEED_LOG,
    SERVED_UNIT,
    UNIT,
    container,
    history,
    invocations_that_ran,
    quarantined,
    settled,
    start_supervisor,
    supervisor_events,
)
from test_setup_e2e import COMMAND, bare, install_wheel

pytestmark = pytest.mark.nspawn
__all__ = ["bare", "container"]  # the fixtures, used by name

ALIAS = "llm.service"
ALIASED_UNIT = SERVED_UNIT.format(log=SEED_LOG) + f"\n[Install]\nAlias={ALIAS}\n"
ALIAS_CONFIG = f"""[[unit]]
name = "{ALIAS}"
unknown_repeat_limit = 3

[metrics]
listen = "127.0.0.1:9464"
"""
PROBE_DROP_IN = f"/etc/systemd/system/{ALIAS}.d/50-probe.conf"


def install_aliased_unit(box: Container) -> None:
    """vllm.service with `Alias=llm.service`, enabled (which links llm.service to it)."""
    box.write_file(f"/etc/systemd/system/{UNIT}", ALIASED_UNIT)
    box.write_file(
        f"/etc/systemd/system/{UNIT}.d/50-e2e-restartsec.conf", "[Service]\nRestartSec=100ms\n"
    )
    box.systemctl("daemon-reload")
    box.systemctl("enable", UNIT)


def test_systemd_applies_an_alias_drop_in_only_while_the_alias_link_exists(
    container: Container,
) -> None:
    """Why setup writes the gate under the real name: a drop-in in `llm.service.d/` does
    apply to vllm.service on 252, but only while the `llm.service` link exists; disabling
    the unit removes the link and, silently, the drop-in (the gate with it)."""
    install_aliased_unit(container)
    container.write_file(PROBE_DROP_IN, "[Service]\nEnvironment=FROM_ALIAS_DROP_IN=1\n")
    container.systemctl("daemon-reload")
    shown = container.show(UNIT, "Id", "Names", "DropInPaths", "Environment")
    assert shown["Id"] == UNIT
    assert set(shown["Names"].split()) == {UNIT, ALIAS}
    assert PROBE_DROP_IN in shown["DropInPaths"]
    assert "FROM_ALIAS_DROP_IN=1" in shown["Environment"]
    # The gate's %n is the real name, whichever name the unit was started by.
    assert (
        f"gate --runtime-dir /run/vllm-supervisor --state-dir /var/lib/vllm-supervisor {UNIT}"
        in (container.show(ALIAS, "ExecCondition")["ExecCondition"])
    )

    container.systemctl("disable", UNIT)
    container.systemctl("daemon-reload")
    shown = container.show(UNIT, "Names", "DropInPaths", "Environment")
    assert shown["Names"] == UNIT
    assert PROBE_DROP_IN not in shown["DropInPaths"]
    assert "FROM_ALIAS_DROP_IN" not in shown["Environment"]


def test_a_config_naming_an_alias_halts_the_real_unit_at_the_first_crash(
    container: Container,
) -> None:
    """The config names llm.service; the seed's fatal crash is halted at the first run, the
    record and the decision are under vllm.service, and the daemon said once that it follows
    the real name."""
    install_aliased_unit(container)
    start_supervisor(container, ALIAS_CONFIG)
    container.systemctl("start", "--no-block", ALIAS)
    wait_for(lambda: quarantined(container), timeout=30, what="the quarantine record")
    wait_for(lambda: settled(container), timeout=30, what="the served unit to stay down")
    record = json.loads(container.run("cat", QUARANTINE).stdout)
    assert record["signature"] == "flashinfer_cubin_mismatch"
    assert len(invocations_that_ran(container)) == 1
    seen = history(container)
    assert (seen[0]["unit"], seen[0]["decision"]["action"], seen[0]["taken"]) == (
        UNIT,
        "halt",
        "halted",
    )
    [said] = supervisor_events(container, "unit_is_an_alias")
    assert (said["unit"], said["real_name"]) == (ALIAS, UNIT)
    assert said["detail"] == f"{ALIAS} is an alias of {UNIT}: following {UNIT}"
    # A person starting the halted unit by its alias is refused like by its real name.
    container.systemctl("start", ALIAS)
    assert len(invocations_that_ran(container)) == 1
    refused = container.run("journalctl", "-u", UNIT, "-o", "cat", "--no-pager").stdout
    assert f"{UNIT}: start refused, quarantined" in refused, refused
    # A person who knows the unit by its alias: status and release find the real unit's record.
    status = container.run("vllm-supervisor", "status", ALIAS, check=False)
    assert "flashinfer_cubin_mismatch" in status.stdout, status.stdout
    released = container.run("vllm-supervisor", "release", ALIAS)
    assert f"released {UNIT}" in released.stdout, released.stdout
    assert not quarantined(container)


def test_setup_for_an_alias_gates_and_permits_the_real_unit(bare: Container, built: Built) -> None:
    """setup from a config naming llm.service writes the gate drop-in under vllm.service.d
    and `vllm.service` into the polkit rule (polkit is asked about the real name), says so,
    and the fatal crash is halted at the first run."""
    install_wheel(bare, built)
    bare.write_file(
        "/etc/vllm-supervisor/supervisor.toml",
        f'[[unit]]\nname = "{ALIAS}"\n\n[metrics]\nlisten = "127.0.0.1:9464"\n',
    )
    install_aliased_unit(bare)
    bare.run(
        "sh", "-c", "chgrp -R systemd-journal /run/log/journal; chmod -R g+rX /run/log/journal"
    )
    bare.systemctl("restart", "systemd-journald")
    done = bare.run(COMMAND, "setup", timeout=120)
    assert f"/etc/systemd/system/{UNIT}.d/10-vllm-supervisor.conf" in done.stdout
    assert f"/{ALIAS}.d" not in done.stdout
    assert f"supervising {UNIT}\n" in done.stdout
    assert f"{ALIAS} is an alias of {UNIT}" in done.stderr, done.stderr
    rule = bare.run("cat", "/etc/polkit-1/rules.d/50-vllm-supervisor.rules").stdout
    assert f'var SUPERVISED_UNITS = ["{UNIT}"]' in rule
    check = bare.run(COMMAND, "check-config", "/etc/vllm-supervisor/supervisor.toml")
    assert f"{ALIAS} is an alias of {UNIT}" in check.stderr, check.stderr
    assert "no gate drop-in" not in check.stderr
    wait_for(
        lambda: bare.show("vllm-supervisor.service", "ActiveState")["ActiveState"] == "active",
        timeout=30,
        what="the supervisor to run",
    )
    wait_for(lambda: supervisor_events(bare, "following_journal"), timeout=30,
             what="the supervisor to follow the journal")  # fmt: skip
    bare.systemctl("start", "--no-block", ALIAS)
    wait_for(lambda: (quarantined(bare) and settled(bare)) or None, timeout=60,
             what="the served unit halted")  # fmt: skip
    assert len(invocations_that_ran(bare)) == 1
    decided = json.loads(bare.run(COMMAND, "history", "--format", "json").stdout)
    assert [i["taken"] for i in decided["invocations"]][:1] == ["halted"]
