"""Installed distributions against what they declare: `pip check` for one served package, and
families of distributions that must share one version.

Package data are read inside the served interpreter by the probe (standard library only, so no
`packaging` is needed there); requirements are evaluated here with `packaging`, against that
interpreter's own PEP 508 marker environment.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from .probe import Probe, normalize_name


@dataclass(frozen=True, slots=True, kw_only=True)
class Family:
    """Distributions that must be installed at one version (when installed at all)."""

    members: tuple[str, ...]
    signature: str  # the id of the crash a mismatch causes
    # member -> the capture name the signature's remediation uses for its version
    captures: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def installed(self, versions: Mapping[str, str]) -> dict[str, str]:
        """The members installed, each with its version."""
        members = [normalize_name(m) for m in self.members]
        return {m: versions[m] for m in members if m in versions}

    def differs(self, installed: Mapping[str, str]) -> bool:
        """True when the installed members are not one public version (local labels such as
        `+cu129` are not compared)."""
        return len({_public(v) for v in installed.values()}) > 1

    def captured(self, installed: Mapping[str, str]) -> dict[str, str]:
        """The versions under the capture names the signature's remediation uses."""
        named = {self.captures[m]: v for m, v in installed.items() if m in self.captures}
        return {**installed, **named}


# flashinfer refuses to start when its packages differ (flashinfer/jit/env.py: "flashinfer-cubin
# version (X) does not match flashinfer version (Y)"); cubin and jit-cache are checked against
# flashinfer-python separately, each with its own crash. Local labels such as flashinfer-jit-cache's
# "+cu129" are not part of the version compared. `captures` are the names the signatures'
# remediation texts use (config/signatures/flashinfer.toml).
DEFAULT_FAMILIES: tuple[Family, ...] = (
    Family(
        members=("flashinfer-python", "flashinfer-cubin"),
        signature="flashinfer_cubin_mismatch",
        captures=MappingProxyType({"flashinfer-python": "flashinfer", "flashinfer-cubin": "cubin"}),
    ),
    Family(
        members=("flashinfer-python", "flashinfer-jit-cache"),
        signature="flashinfer_jit_cache_mismatch",
        captures=MappingProxyType(
            {"flashinfer-python": "flashinfer", "flashinfer-jit-cache": "jit_cache"}
        ),
    ),
)


def _public(version: str) -> str:
    try:
        return Version(version).public
    except InvalidVersion:
        return version


def unmet(name: str, found: Probe) -> Iterator[str]:
    """Like `pip check` for one distribution: its requirements the environment breaks."""
    environment = {**found.markers, "extra": ""}
    owner = f"{name} {found.versions[name]}"
    for text in found.requires[name]:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue  # pip would not have installed it either; nothing to compare
        if req.marker is not None and not req.marker.evaluate(environment):
            continue
        have = found.versions.get(normalize_name(req.name))
        if have is None:
            yield f"{owner} requires {req}, which is not installed"
        elif req.url is None and not _satisfies(req, have):
            yield f"{owner} requires {req}, but {req.name} {have} is installed"


def _satisfies(req: Requirement, version: str) -> bool:
    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return True  # a legacy version cannot be compared; don't block a start on it
