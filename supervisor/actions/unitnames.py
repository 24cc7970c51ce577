"""The configured units under their real names: a configured name may be an alias.

systemd logs a unit's entries (`_SYSTEMD_UNIT`, PID 1's `UNIT=`), expands `%n` in its drop-ins
and asks polkit about it under its real name, its `Id`, whichever name it was started by. A
config naming `llm.service`, an `Alias=` of `vllm.service`, would follow a name the journal
never carries: nothing would ever be decided. So the daemon asks systemd for each configured
unit's `Id` and `Names` at start and at each reload, and supervises the `Id` with the settings
configured for the alias. Where systemd cannot be asked, the names stay as configured (and a
name it answered about before keeps that answer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from ..config import Config, UnitConfig
from ..errors import SystemdError
from .systemd import ask_once

log = structlog.get_logger(__name__)


class NamesSource(Protocol):
    """What resolution asks systemd (actions.systemd.SystemdClient)."""

    async def unit_names(self, unit: str) -> tuple[str, tuple[str, ...]]: ...


@dataclass(frozen=True, slots=True)
class Resolution:
    """What systemd said about the configured unit names."""

    real: dict[str, str] = field(default_factory=dict)  # configured name -> its Id
    names: dict[str, str] = field(default_factory=dict)  # every name of those units -> Id
    not_found: tuple[str, ...] = ()
    trouble: str | None = None  # why systemd could not be asked (the rest left unanswered)

    def aliases(self) -> dict[str, str]:
        """The configured names that are aliases, each with its unit's real name."""
        return {name: real for name, real in self.real.items() if name != real}


async def ask_names(systemd: NamesSource, units: Sequence[str]) -> Resolution:
    """Ask systemd for each unit's Id and Names; stop asking at the first failure that is not
    "no such unit" (no bus, a timeout: the next ones would wait as long)."""
    real: dict[str, str] = {}
    names: dict[str, str] = {}
    not_found: list[str] = []
    for unit in units:
        try:
            unit_id, aliases = await systemd.unit_names(unit)
        except SystemdError as exc:
            if exc.reason == "no_such_unit":
                not_found.append(unit)
                continue
            return Resolution(real, names, tuple(not_found), str(exc) or exc.reason)
        except Exception as exc:  # an answer of an unexpected shape: as if it could not be asked
            return Resolution(real, names, tuple(not_found), repr(exc))
        real[unit] = unit_id
        names.update(dict.fromkeys([unit, unit_id, *aliases], unit_id))
    return Resolution(real, names, tuple(not_found))


def under_real_names(
    units: Sequence[UnitConfig], real: Mapping[str, str]
) -> tuple[tuple[UnitConfig, ...], dict[str, str]]:
    """`units` renamed to their real names, each keeping its settings; and the configured
    names left out because another entry names the same unit (-> the configured name whose
    settings were kept: the entry that names the unit's Id itself, else the first)."""
    kept: dict[str, int] = {}  # real name -> index of the entry kept for it
    for index, unit in enumerate(units):
        name = real.get(unit.name, unit.name)
        first = kept.get(name)
        if first is None or (unit.name == name and units[first].name != name):
            kept[name] = index
    renamed = tuple(dataclasses.replace(units[i], name=name) for name, i in kept.items())
    chosen = set(kept.values())
    dropped = {
        unit.name: units[kept[real.get(unit.name, unit.name)]].name
        for index, unit in enumerate(units)
        if index not in chosen
    }
    return renamed, dropped


class RealNames:
    """Puts the configured units under their real names, and knows every name of each."""

    def __init__(self, systemd: NamesSource | None) -> None:
        self._systemd = systemd  # None: never asked (a journal directory, systemd disabled)
        self._real: dict[str, str] = {}  # what systemd said so far: configured name -> Id
        self._names: dict[str, str] = {}

    def real_name(self, name: str) -> str:
        """The real name of `name` when it is a name of a configured unit, else `name`."""
        return self._names.get(name, name)

    async def resolve(self, config: Config) -> Config:
        """`config` with every unit under its real name; one line per alias, per unknown
        name, per duplicate, and once when systemd cannot be asked."""
        if self._systemd is None:
            return config
        configured = [u.name for u in config.units]
        found = await ask_names(self._systemd, configured)
        if found.trouble is not None:
            log.warning(
                "unit_names_unresolved",
                error=found.trouble,
                action="following the names as configured (an alias of the unit that runs "
                "is never decided); asked again at the next reload",
            )
        answered = set(found.real) | set(found.not_found)
        real = {
            **{n: r for n, r in self._real.items() if n in configured and n not in answered},
            **found.real,
        }
        self._real = real
        # Names learnt before stay known for the units still configured (systemd unreachable).
        still = set(real.values())
        self._names = {n: r for n, r in self._names.items() if r in still} | found.names
        for name, real_name in sorted(real.items()):
            if name != real_name:
                log.info(
                    "unit_is_an_alias",
                    unit=name,
                    real_name=real_name,
                    detail=f"{name} is an alias of {real_name}: following {real_name}",
                )
        for name in found.not_found:
            log.warning(
                "unit_not_found",
                unit=name,
                action="following it by this name; check the [[unit]] name "
                f"(`systemctl status {name}`)",
            )
        units, dropped = under_real_names(config.units, real)
        for name, kept in sorted(dropped.items()):
            log.warning(
                "unit_listed_twice",
                unit=name,
                real_name=real.get(name, name),
                action=f"the same unit as [[unit]] {kept}: its settings apply; remove one entry",
            )
        return dataclasses.replace(config, units=units)


def real_name(unit: str, *, timeout_s: float = 2.0) -> str:
    """For a command a person runs (`release`, `status`): the unit's real name when `unit` is
    an alias systemd knows, else `unit` as typed (systemd unreachable, no such unit)."""
    try:
        real, _ = ask_once(lambda client: client.unit_names(unit), timeout_s=timeout_s)
    except (SystemdError, OSError, TimeoutError):
        return unit
    return real
