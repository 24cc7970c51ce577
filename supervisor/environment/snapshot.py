"""Environment snapshots and their differences.

A unit that ran for weeks and now crashes at every start usually changed underneath: someone ran
`pip install -U` in its virtual environment, or the NVIDIA driver was upgraded. An `EnvSnapshot`
is taken when an invocation starts; `diff` names what changed since the last good start
(`flashinfer-python 0.6.3 → 0.6.4`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .probe import (
    NVIDIA_VERSION_PATH,
    Probe,
    normalize_name,
    probe,
    read_nvidia_driver,
)

_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvSnapshot:
    """The versions that matter for one start of a served unit."""

    python: str  # interpreter version
    packages: Mapping[str, str] = field(default_factory=lambda: _EMPTY)  # installed ones only
    checked: tuple[str, ...] = ()  # the normalised names looked for (installed or not)
    nvidia_driver: str | None = None
    executable: str | None = None  # the interpreter path, for display; never diffed

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; `from_json` reads it back."""
        return {
            "python": self.python,
            "packages": dict(sorted(self.packages.items())),
            "checked": list(self.checked),
            "nvidia_driver": self.nvidia_driver,
            "executable": self.executable,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> EnvSnapshot:
        """Rebuild a snapshot written by `to_json`."""
        packages = {str(k): str(v) for k, v in raw.get("packages", {}).items()}
        driver, executable = raw.get("nvidia_driver"), raw.get("executable")
        return cls(
            python=str(raw["python"]),
            packages=MappingProxyType(packages),
            checked=tuple(str(n) for n in raw.get("checked", sorted(packages))),
            nvidia_driver=None if driver is None else str(driver),
            executable=None if executable is None else str(executable),
        )


def snapshot(
    python: Path,
    packages: Sequence[str],
    *,
    timeout_s: float = 5,
    nvidia_version_path: Path = NVIDIA_VERSION_PATH,
) -> EnvSnapshot:
    """Record the interpreter version, the given packages' versions and the NVIDIA driver.

    Blocking (a subprocess of up to `timeout_s`): call it through `asyncio.to_thread` from the
    daemon. Raises `ProbeError` when the interpreter cannot be run.
    """
    found = probe(python, timeout_s=timeout_s)
    return snapshot_from_probe(
        found, packages, executable=python, nvidia_driver=read_nvidia_driver(nvidia_version_path)
    )


def snapshot_from_probe(
    found: Probe, packages: Sequence[str], *, executable: Path, nvidia_driver: str | None
) -> EnvSnapshot:
    """The snapshot a probe already run implies (preflight probes once for both uses)."""
    checked = tuple(sorted({normalize_name(n) for n in packages}))
    return EnvSnapshot(
        python=found.python,
        packages=MappingProxyType({n: found.versions[n] for n in checked if n in found.versions}),
        checked=checked,
        nvidia_driver=nvidia_driver,
        executable=str(executable),
    )


class ChangeKind(StrEnum):
    """How one package (or the interpreter, or the driver) differs between two snapshots."""

    ADDED = "added"
    REMOVED = "removed"
    CHANGED = "changed"


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """One difference between two snapshots; `name` is a package, `python` or `nvidia-driver`."""

    name: str
    before: str | None
    after: str | None

    @property
    def kind(self) -> ChangeKind:
        """Added, removed or changed."""
        if self.before is None:
            return ChangeKind.ADDED
        if self.after is None:
            return ChangeKind.REMOVED
        return ChangeKind.CHANGED

    def __str__(self) -> str:
        if self.before is None:
            return f"{self.name} added {self.after}"
        if self.after is None:
            return f"{self.name} removed (was {self.before})"
        return f"{self.name} {self.before} → {self.after}"


def diff(before: EnvSnapshot, after: EnvSnapshot) -> list[Change]:
    """What changed from `before` to `after`: interpreter, driver, then packages by name.

    Only packages both snapshots looked for are compared, so adding a name to the configured list
    does not show up as a package that appeared.
    """
    changes = [
        Change(name=name, before=old, after=new)
        for name, old, new in (
            ("python", before.python, after.python),
            ("nvidia-driver", before.nvidia_driver, after.nvidia_driver),
        )
        if old != new
    ]
    for name in sorted(set(before.checked) & set(after.checked)):
        old, new = before.packages.get(name), after.packages.get(name)
        if old != new:
            changes.append(Change(name=name, before=old, after=new))
    return changes


def render_changes(changes: Sequence[Change]) -> str:
    """One line for a notification or a log: `flashinfer-python 0.6.3 → 0.6.4; torch …`."""
    return "; ".join(str(c) for c in changes) if changes else "no changes"
