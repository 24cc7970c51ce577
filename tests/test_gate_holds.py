"""The gate and `release` with a held start (supervisor.actions.holds): a hold refuses only
what systemd will start later; anything else lets the start through and says so.

systemd's side (the transient timer that starts the unit at the deadline) runs in
tests/e2e/test_pacing_e2e.py; here the bus is one nobody answers, the fail-open half.
"""

from __future__ import annotations

import io
import json
import socket
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_supervisor.actions.holds import Hold, Holds, hold_dir, timer_name
from vllm_supervisor.actions.quarantine import Quarantine
from vllm_supervisor.commands.gate import EXIT_ALLOW, gate_main, recheck_main, release_main

UNIT = "vllm.service"
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@pytest.fixture(autouse=True)
def no_systemd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A system bus that nobody answers: systemd cannot take a deferred start."""
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path}/no-bus")


def _hold(until: float, crashes: int = 3) -> Hold:
    return Hold(
        unit=UNIT,
        until=until,
        since=time.time(),
        crashes=crashes,
        reason="unknown crash; paced",
        rule="unknown_no_cause",
    )


def _write(runtime: Path, hold: Hold) -> None:
    path = Holds(hold_dir(runtime)).path(hold.unit)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(hold.to_record()))


def _gate(runtime: Path) -> tuple[int, str]:
    out = io.StringIO()
    code = gate_main(UNIT, runtime, runtime.parent / "state", wait_s=1.0, out=out, defaults=())
    return code, out.getvalue()


def test_a_hold_systemd_will_not_end_lets_the_start_through(tmp_path: Path) -> None:
    """Refusing a start that nothing would start later is an outage, not a hold."""
    _write(tmp_path / "run", _hold(time.time() + 600))
    code, said = _gate(tmp_path / "run")
    assert code == EXIT_ALLOW
    assert "start allowed: it is held until" in said
    assert "systemd would not take the start at that time" in said


def test_an_expired_hold_holds_nothing(tmp_path: Path) -> None:
    _write(tmp_path / "run", _hold(time.time() - 1))
    code, said = _gate(tmp_path / "run")
    assert code == EXIT_ALLOW
    assert "held" not in said


@given(record=JSON)
@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_no_hold_record_makes_the_gate_fail_or_refuse(tmp_path: Path, record: object) -> None:
    """A hold record of any shape (root can write anything there): the gate answers 0 (no bus
    takes a deferred start here), never 2 and never a traceback."""
    path = Holds(hold_dir(tmp_path / "run")).path(UNIT)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    assert _gate(tmp_path / "run")[0] == EXIT_ALLOW


def test_release_ends_the_hold_and_says_when_it_cannot_start_the_unit(tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    _write(runtime, _hold(time.time() + 600))
    out = io.StringIO()
    code = release_main(UNIT, runtime, tmp_path / "state", out=out, defaults=())
    assert "ended the hold of vllm.service" in out.getvalue()
    assert code == 1  # no systemd to start it: said, with the command to run
    assert Holds(hold_dir(runtime)).read(UNIT) is None
    assert _gate(runtime)[0] == EXIT_ALLOW


@given(unit=st.text(min_size=1, max_size=300), until=st.floats(0, 4e9, allow_nan=False))
def test_a_timer_name_is_a_unit_name_systemd_takes(unit: str, until: float) -> None:
    """Any unit name, any deadline: a valid timer name (systemd's characters, its length)."""
    name = timer_name(unit, until)
    assert name.endswith(".timer") and len(name) <= 255
    stem = name.removesuffix(".timer")
    assert all(c.isascii() and (c.isalnum() or c in ":_.-") for c in stem), name


class TestRecheck:
    """`recheck`, the timer's command for a halt that can clear by itself."""

    @staticmethod
    def _halt(state: Path, evidence: dict[str, object] | None) -> None:
        Quarantine(state / "quarantine").write(
            UNIT,
            {
                "signature": "port_in_use",
                "time": "2026-12-04T10:00:00+00:00",
                **({"evidence": evidence} if evidence else {}),
            },
        )

    def _recheck(self, tmp_path: Path) -> tuple[int, str]:
        out = io.StringIO()
        code = recheck_main(UNIT, tmp_path / "run", tmp_path / "state", out=out, defaults=())
        return code, out.getvalue()

    def test_a_freed_port_lifts_the_halt_and_starts_the_unit(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        self._halt(tmp_path / "state", {"kind": "port_held", "port": free})
        code, said = self._recheck(tmp_path)
        assert f"the halt is lifted, port {free} is free now" in said
        assert Quarantine(tmp_path / "state" / "quarantine").read(UNIT) is None
        assert code == 1  # no systemd here to start it: said, with the command to run
        assert f"systemctl start {UNIT}" in capsys.readouterr().err

    def test_a_held_port_keeps_the_halt_and_asks_to_be_checked_again(self, tmp_path: Path) -> None:
        with socket.socket() as holder:
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            port = holder.getsockname()[1]
            self._halt(tmp_path / "state", {"kind": "port_held", "port": port})
            code, said = self._recheck(tmp_path)
        assert Quarantine(tmp_path / "state" / "quarantine").read(UNIT) is not None
        assert f"port {port} is still held by" in said
        assert code == 1 and "not checked again by itself" in said  # no systemd here

    def test_a_halt_with_no_cause_that_can_clear_waits_for_a_person(self, tmp_path: Path) -> None:
        self._halt(tmp_path / "state", None)
        code, said = self._recheck(tmp_path)
        assert code == 0 and "halted for good" in said
        assert Quarantine(tmp_path / "state" / "quarantine").read(UNIT) is not None

    def test_nothing_halted_nothing_done(self, tmp_path: Path) -> None:
        assert self._recheck(tmp_path) == (0, f"{UNIT}: no halt to check again\n")

    @given(record=JSON)
    @settings(
        max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )
    def test_no_record_makes_recheck_fail(self, tmp_path: Path, record: object) -> None:
        path = Quarantine(tmp_path / "state" / "quarantine").path(UNIT)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
        assert self._recheck(tmp_path)[0] in (0, 1)
        assert path.exists() or isinstance(record, dict)  # only a readable cause is lifted
