"""`vllm-supervisor status` shows a paced unit: when its held start comes, after how many
crashes, by which rule and why, and how to start it now; in text and as the `hold` object of
`--format json`. A hold whose time has passed is no hold (the gate lets that start through),
so it is not shown as paced. A hold record is a file anyone with root may edit: whatever it
holds, status reads it without a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from faults.harness import write_config
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor import cli
from vllm_supervisor.actions.holds import Hold, Holds, hold_dir
from vllm_supervisor.actions.quarantine import record_name
from vllm_supervisor.commands.status import (
    EXIT_DAEMON_DOWN,
    EXIT_HEALTHY,
    DaemonStatus,
    Status,
    UnitStatus,
    _unit_status,
    gather,
    render_text,
    standing_hold,
    status_main,
)
from vllm_supervisor.config import Config, StateConfig, UnitConfig
from vllm_supervisor.model import UnitState

UNIT = "vllm.service"
NOW = datetime(2027, 1, 15, 10, 39, tzinfo=UTC).timestamp()
REASON = (
    "unknown: no error line names the cause; paced: 4 crashes in a row of starts that never "
    "served, so the next start waits 8 min"
)


def config_in(root: Path) -> Config:
    return Config(
        units=(UnitConfig(name=UNIT),),
        state=StateConfig(state_dir=root / "state", runtime_dir=root / "run"),
    )


def a_hold(until: float, *, crashes: int = 4) -> Hold:
    return Hold(
        unit=UNIT,
        until=until,
        since=until - 480,
        crashes=crashes,
        reason=REASON,
        rule="unknown_no_cause",
        invocation_id="0f3c2d1e",
        signature=None,
    )


def write_hold(config: Config, hold: Hold) -> None:
    """The record as the daemon writes it."""
    asyncio.run(Holds(hold_dir(config.state.runtime_dir)).write(hold))


def write_raw(config: Config, content: bytes) -> None:
    """A record file holding whatever someone with root put there."""
    directory = hold_dir(config.state.runtime_dir)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / record_name(UNIT)).write_bytes(content)


def running_unit(units: Sequence[str]) -> dict[str, UnitState | str]:
    return dict.fromkeys(units, "systemd not asked in this test")


def status_of(config: Config, *, now: float = NOW) -> tuple[int, str, dict[str, Any]]:
    """`status` in text and JSON, at `now`: (exit code, text, the unit's JSON entry)."""
    text, raw = io.StringIO(), io.StringIO()
    code = status_main(config, [UNIT], out=text, unit_states=running_unit, clock=lambda: now)
    status_main(
        config,
        [UNIT],
        output_format="json",
        out=raw,
        unit_states=running_unit,
        clock=lambda: now,
    )
    (unit,) = json.loads(raw.getvalue())["units"]
    return code, text.getvalue(), unit


def test_a_standing_hold_says_when_after_what_and_why(tmp_path: Path) -> None:
    """The next start's time and how far off it is, the crashes in a row, the rule, the
    policy's reason and the release command; the same facts in JSON."""
    config = config_in(tmp_path)
    write_hold(config, a_hold(NOW + 180))
    code, text, unit = status_of(config)
    assert f"● {UNIT}: paced" in text
    assert (
        "    paced:     next start 10:42 UTC (in 3 min), after 4 crashes in a row "
        "(unknown_no_cause)\n"
    ) in text
    assert f"    why:       {REASON}\n" in text
    assert f"    start now: vllm-supervisor release {UNIT}" in text
    assert "systemctl list-timers 'vllm-supervisor-hold-*'" in text
    hold = unit["hold"]
    assert hold["until"] == "2027-01-15T10:42:00+00:00"
    assert hold["until_epoch"] == NOW + 180
    assert hold["left_s"] == 180
    assert hold["since"] == "2027-01-15T10:34:00+00:00"
    assert (hold["crashes"], hold["rule"], hold["reason"]) == (4, "unknown_no_cause", REASON)
    assert hold["invocation_id"] == "0f3c2d1e"
    assert unit["hold_error"] is None
    assert code == EXIT_DAEMON_DOWN  # no daemon runs here: its own line says so


@pytest.mark.parametrize("until", [NOW - 600, NOW - 1, NOW], ids=["long-gone", "just", "now"])
def test_a_hold_whose_time_came_is_not_paced(tmp_path: Path, until: float) -> None:
    """The gate lets a start through from the hold's deadline on: status says nothing of it."""
    config = config_in(tmp_path)
    write_hold(config, a_hold(until))
    _, text, unit = status_of(config)
    assert "paced:" not in text and f"{UNIT}: paced" not in text
    assert unit["hold"] is None


def test_one_crash_and_a_far_deadline_are_said_right(tmp_path: Path) -> None:
    """One crash is said "1 crash"; a start more than half a day off shows its date."""
    config = config_in(tmp_path)
    write_hold(config, a_hold(NOW + 2 * 86400, crashes=1))
    _, text, _ = status_of(config)
    assert "next start 2027-01-17 10:39 UTC (in 48 h 0 min), after 1 crash in a row" in text


def test_no_hold_no_paced_line(tmp_path: Path) -> None:
    """A unit that was never held has no paced line and a null `hold`."""
    _, text, unit = status_of(config_in(tmp_path))
    assert "paced:" not in text and f"{UNIT}: paced" not in text
    assert (unit["hold"], unit["hold_error"]) == (None, None)


def test_hold_records_that_cannot_be_read_are_said(tmp_path: Path) -> None:
    """A hold directory that cannot be listed (here a file stands where it goes): said, and
    the rest of the screen is shown."""
    config = config_in(tmp_path)
    config.state.runtime_dir.mkdir(parents=True)
    hold_dir(config.state.runtime_dir).write_text("not a directory\n")
    _, text, unit = status_of(config)
    assert "    paced:     unknown (cannot read the hold records: " in text
    assert "cannot read the hold records" in unit["hold_error"]
    assert text.startswith(f"● {UNIT}: ")


def test_a_paced_unit_leaves_a_healthy_exit_status() -> None:
    """A hold ends by itself: a paced unit with a healthy daemon exits 0, not 1."""
    unit = _unit_status(
        UNIT, "systemd not asked", None, [], hold=standing_hold(a_hold(NOW + 60), NOW)
    )
    daemon = DaemonStatus(running=True, pid=1, healthy=True)
    assert unit.hold is not None
    assert Status(units=(unit,), daemon=daemon).exit_code == EXIT_HEALTHY


def test_the_command_line_shows_the_hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`vllm-supervisor status --config ...` reads the holds of the configured runtime
    directory (the harness config: runtime_dir = root/run)."""
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={tmp_path}/no-bus")
    path = write_config(tmp_path)
    config = config_in(tmp_path)
    write_hold(config, a_hold(datetime.now(UTC).timestamp() + 3600))
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        cli.main(["status", "--config", str(path)])
    assert f"● {UNIT}: paced" in out.getvalue()
    assert "after 4 crashes in a row" in out.getvalue()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        cli.main(["status", "--config", str(path), "--format", "json"])
    (unit,) = json.loads(out.getvalue())["units"]
    assert unit["hold"]["crashes"] == 4


# -- records of any shape --------------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from([NOW - 1, NOW, NOW + 1, NOW + 1e10, 9e11, -9e11, 1e300]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)
HOLD_KEYS = ["kind", "unit", "until", "since", "crashes", "reason", "rule", "invocation_id"]
RECORD = st.dictionaries(st.sampled_from(HOLD_KEYS), JSON) | st.dictionaries(
    st.text(max_size=8), JSON, max_size=4
)


def encoded(value: object) -> bytes:
    # allow_nan: Python's json writes (and reads) NaN and Infinity; a record may hold them.
    return json.dumps(value, allow_nan=True).encode()


def shown(config: Config) -> tuple[str, UnitStatus]:
    """The text screen and the unit's status, with the JSON written as `status` writes it."""
    status = gather(
        config, [UNIT], unit_states=running_unit, health=lambda url: "unused", clock=lambda: NOW
    )
    json.dumps(status.to_json())  # as `--format json` writes it
    (unit,) = status.units
    return render_text(status), unit


@given(content=st.binary(max_size=200) | RECORD.map(encoded) | JSON.map(encoded))
def test_any_record_file_renders(content: bytes) -> None:
    """Bytes, JSON of any shape, numbers out of range, NaN: a screen, never a traceback; a
    paced line exactly when the record names a deadline still ahead."""
    with tempfile.TemporaryDirectory() as root:
        config = config_in(Path(root))
        write_raw(config, content)
        text, unit = shown(config)
        hold = Holds(hold_dir(config.state.runtime_dir)).read(UNIT)
    assert text.startswith(f"● {UNIT}: ")
    standing = hold is not None and hold.until > NOW
    assert (unit.hold is not None) == standing
    assert ("    paced:     next start " in text) == standing


@given(
    until=st.floats(min_value=NOW - 86400 * 365, max_value=NOW + 86400 * 365),
    crashes=st.integers(min_value=0, max_value=10**6),
)
def test_a_readable_record_is_paced_exactly_while_its_time_is_ahead(
    until: float, crashes: int
) -> None:
    """A record the daemon could have written: paced iff its deadline is after now, and its
    JSON `until` is that deadline to the second."""
    with tempfile.TemporaryDirectory() as root:
        config = config_in(Path(root))
        write_raw(config, encoded(a_hold(until, crashes=crashes).to_record()))
        _, unit = shown(config)
    assert (unit.hold is not None) == (until > NOW)
    if unit.hold is not None:
        parsed = datetime.fromisoformat(unit.hold["until"]).timestamp()
        assert abs(parsed - until) < 1
        assert unit.hold["crashes"] == crashes
