"""Held starts: a paced unit's record with its deadline, and the systemd timer that starts the
unit then.

A hold is not a halt: it ends by itself. The daemon writes the record (one file per unit under
the runtime directory's `hold/`, beside `quarantine/`, so neither overwrites the other); the
gate (`ExecCondition=`, as root) refuses a start before the deadline only once systemd holds a
transient timer that starts the unit at the deadline. So the deferred start is systemd's own:
it comes when the supervisor is stopped, killed or restarting, and `systemctl list-timers` shows
it. An expired or unreadable record, or a timer systemd would not take, lets the start through
(the gate says so): a hold fails open, never into an outage. The records live under /run, so a
reboot forgets them and the unit starts at boot, as systemd would start it.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import DEFAULT_RUNTIME_DIR, Config
from ..errors import SystemdError
from ..util.jsontext import whole_number
from ..util.text import bounded
from .quarantine import Quarantine
from .systemd import SystemdClient, ask_once

HOLD_SUBDIR = "hold"
TIMER_PREFIX = "vllm-supervisor-hold-"
REASON_LIMIT = 500  # characters of a reason kept in a record: it is shown, never parsed
SYSTEMD_TIMEOUT_S = 5.0
_NAME_PART_MAX = 160
_FAR_FUTURE = 1e12  # unix seconds past any date a hold names
_NOT_IN_A_NAME = re.compile(r"[^A-Za-z0-9:_.-]")


@dataclass(frozen=True, slots=True, kw_only=True)
class Hold:
    """One unit's held start: no start before `until` (unix time)."""

    unit: str
    until: float
    since: float  # when it was decided
    crashes: int  # crashes in a row of starts that ended within the pacing's reset
    reason: str
    rule: str
    invocation_id: str | None = None
    signature: str | None = None

    def left_s(self, now: float) -> float:
        """Seconds until the start may run; 0 once it may."""
        return max(0.0, self.until - now)

    def to_record(self) -> dict[str, Any]:
        return {
            "kind": "hold",
            "unit": self.unit,
            "until": self.until,
            "since": self.since,
            "crashes": self.crashes,
            "reason": bounded(self.reason, REASON_LIMIT),
            "rule": self.rule,
            "invocation_id": self.invocation_id,
            "signature": self.signature,
        }

    @classmethod
    def from_record(cls, unit: str, record: dict[str, Any]) -> Hold | None:
        """The hold a record holds; None for one that is not a readable hold (it holds
        nothing: a hold fails open)."""
        until, since, crashes = record.get("until"), record.get("since"), record.get("crashes")
        if not all(_finite(value) for value in (until, since)):
            return None
        return cls(
            unit=unit,
            until=float(until),  # type: ignore[arg-type]
            since=float(since),  # type: ignore[arg-type]
            crashes=whole_number(crashes),
            reason=str(record.get("reason") or ""),
            rule=str(record.get("rule") or ""),
            invocation_id=_text_or_none(record.get("invocation_id")),
            signature=_text_or_none(record.get("signature")),
        )


def hold_dir(runtime_dir: Path) -> Path:
    """Where the holds of a daemon with this runtime directory are kept."""
    return runtime_dir / HOLD_SUBDIR


def hold_dirs(runtime_dir: Path, defaults: Sequence[Path] = (DEFAULT_RUNTIME_DIR,)) -> list[Path]:
    """Every directory a hold may be in, whatever the daemon's settings."""
    return list(dict.fromkeys(hold_dir(base) for base in (runtime_dir, *defaults)))


class Holds:
    """The hold records in one directory (written atomically, as quarantine records are)."""

    def __init__(self, directory: Path) -> None:
        self._records = Quarantine(directory)
        self.directory = directory

    def path(self, unit: str) -> Path:
        return self._records.path(unit)

    async def write(self, hold: Hold) -> Path:
        """Record `hold` (replacing the unit's earlier one), from the event loop."""
        return await self._records.write_async(hold.unit, hold.to_record())

    def read(self, unit: str) -> Hold | None:
        """The unit's hold; None when there is none, or it is not readable as one."""
        record = self._records.read(unit)
        return None if record is None else Hold.from_record(unit, record)

    def remove(self, unit: str) -> Hold | None:
        """Remove the unit's hold; the hold removed."""
        record = self._records.release(unit)
        return None if record is None else Hold.from_record(unit, record)

    def all(self) -> dict[str, Hold]:
        """Every unit's readable hold."""
        found = {}
        for unit, record in self._records.list().items():
            hold = Hold.from_record(unit, record)
            if hold is not None:
                found[unit] = hold
        return found


def holds_of(config: Config) -> dict[str, Hold]:
    """Every unit's hold in the daemon's runtime directory."""
    return Holds(hold_dir(config.state.runtime_dir)).all()


def active_hold(unit: str, directories: Sequence[Path], now: float) -> Hold | None:
    """The unit's hold whose deadline is still ahead, the latest of them; OSErrors propagate."""
    found = [Holds(directory).read(unit) for directory in directories if directory.is_dir()]
    ahead = [hold for hold in found if hold is not None and hold.until > now]
    return max(ahead, key=lambda hold: hold.until, default=None)


def timer_name(unit: str, until: float) -> str:
    """The transient timer of a hold: one per unit and deadline, so a second arm of the same
    hold finds it armed (systemd answers UnitExists) and never starts it twice."""
    return f"{TIMER_PREFIX}{_name_part(unit)}-{math.ceil(until)}.timer"


def start_command(unit: str) -> list[str]:
    """What the timer runs: a start of the unit (queued; its own gate then lets it through)."""
    systemctl = shutil.which("systemctl") or "/bin/systemctl"
    return [systemctl, "start", "--no-block", unit]


async def arm(client: SystemdClient, hold: Hold) -> str:
    """Have systemd start the held unit at the hold's deadline; the timer's name."""
    return await arm_command(
        client,
        hold.unit,
        hold.until,
        start_command(hold.unit),
        f"Start {hold.unit} when its hold by vllm-supervisor ends",
    )


async def arm_command(
    client: SystemdClient, unit: str, at: float, argv: Sequence[str], description: str
) -> str:
    """Have systemd run `argv` (as root) at `at` for `unit`; the timer's name. Other timers of
    the unit are stopped first: only the latest stands."""
    name = timer_name(unit, at)
    await disarm(client, unit, keep=name)
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(math.ceil(max(at, time.time() + 1))))
    try:
        await client.start_transient_timer(
            name, description=description, on_calendar=when, argv=argv
        )
    except SystemdError as exc:
        if exc.reason != "unit_exists":
            raise
    return name


async def disarm(client: SystemdClient, unit: str, *, keep: str | None = None) -> list[str]:
    """Stop every hold timer of `unit` (but `keep`); the timers stopped."""
    pattern = f"{TIMER_PREFIX}{_name_part(unit)}-*.timer"
    stopped = []
    for name in await client.units_matching([pattern]):
        if name != keep and name.endswith(".timer"):
            with contextlib.suppress(SystemdError):  # gone meanwhile: nothing to stop
                await client.stop_unit(name)
                stopped.append(name)
    return stopped


def arm_once(hold: Hold) -> str:
    """`arm`, for the gate (a one-shot command); SystemdError, OSError and TimeoutError reach
    the caller, which then lets the start through."""
    return ask_once(lambda client: arm(client, hold), timeout_s=SYSTEMD_TIMEOUT_S)


def arm_recheck_once(unit: str, at: float, argv: Sequence[str]) -> str:
    """Have systemd run `argv` (the halt's recheck) at `at`; errors reach the caller."""
    description = f"Start {unit} if the cause of its halt by vllm-supervisor is gone"
    return ask_once(
        lambda client: arm_command(client, unit, at, argv, description),
        timeout_s=SYSTEMD_TIMEOUT_S,
    )


def disarm_once(unit: str) -> list[str]:
    """`disarm`, for a one-shot command; errors reach the caller."""
    return ask_once(lambda client: disarm(client, unit), timeout_s=SYSTEMD_TIMEOUT_S)


def start_once(unit: str) -> None:
    """Start `unit` now (`release` of a hold); errors reach the caller."""

    async def start(client: SystemdClient) -> None:
        await client.start_unit(unit)

    ask_once(start, timeout_s=SYSTEMD_TIMEOUT_S)


def _name_part(unit: str) -> str:
    """`unit` as part of a unit name: systemd's characters only, and short enough that the
    timer's name stays under systemd's 255 (a long name keeps its head and a hash)."""
    name = _NOT_IN_A_NAME.sub("_", unit)
    if len(name) <= _NAME_PART_MAX:
        return name
    digest = hashlib.sha256(unit.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return f"{name[: _NAME_PART_MAX - 17]}_{digest}"


def _finite(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and abs(float(value)) < _FAR_FUTURE
    )


def _text_or_none(value: object) -> str | None:
    return bounded(value, REASON_LIMIT) if isinstance(value, str) and value else None
