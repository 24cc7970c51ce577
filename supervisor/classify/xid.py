"""NVIDIA's Xid lines and the catalog that says what each one means (`config/xid.toml`).

When a GPU faults, the driver writes `NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3,
GPU has fallen off the bus.` to the kernel's log; the engine dies a moment later with a CUDA
error that says nothing of why. The catalog (data, validated like the signature table: one line
naming the file and the key) says per Xid what it means, NVIDIA's recommended action (restart
the application, reset the GPU, reboot the node, contact support) and whether a restart of the
engine can help. supervisor.decide.xid_evidence joins an Xid to the crash it caused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..errors import ConfigError
from ..util.files import data_path, read_toml

DEFAULT_XID_PATH: Path = data_path("xid.toml")
# `NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.`; older
# drivers print the address without `PCI:` (`NVRM: Xid (0000:01:00): 13, ...`), MIG adds the
# instance (`(PCI:0000:01:00 GPU-I:05): 94, ...`).
_XID_LINE = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)"
    r"(?: GPU-I:\d{1,3}(?: GPU-CI:\d{1,3})?)?\): "
    r"(?P<xid>\d{1,4})\b,?[ \t]*(?P<rest>[^\n]*)"
)
# The driver's probe finding a GPU gone, one record of three lines: `NVRM: The NVIDIA GPU
# 0000:b3:00.0\nNVRM: (PCI ID: 10de:26b5) installed in this system has\nNVRM: fallen off the
# bus and is not responding to commands.`: Xid 79's fault, said when the driver loads.
_FALLEN_AT_PROBE = re.compile(
    r"NVRM: The NVIDIA GPU (?P<pci>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?)\b"
    r"[^\n]{0,80}(?:\n[^\n]{0,160}){0,3}?[ \n](?:NVRM: )?fallen off the bus\b"
)
FALLEN_OFF_THE_BUS = 79
# Xid 45 names the fault it cleaned up after: `..., Ch 00000001 caused by previous Xid 149`.
_FOLLOWS = re.compile(r"\bcaused by previous Xid (\d{1,4})\b")
_PID = re.compile(r"\bpid=(?:'[^']*'|\d+|<unknown>),\s*(?:name=[^,]*,\s*)?")
ACTIONS: Mapping[str, str] = MappingProxyType(
    {
        "restart_app": "restart the application",
        "reset_gpu": "reset the GPU (nvidia-smi -r, with nothing using it) or reboot",
        "reboot": "reboot the node",
        "drain": "drain the node and contact support (the GPU needs service)",
        "contact_support": "contact support if it repeats",
        "none": "nothing: informational",
    }
)
# Whether a restart of the engine alone can get past it: the others need the GPU reset first.
RESTART_HELPS = frozenset({"restart_app", "contact_support", "none"})
_KEYS: Mapping[str, type] = MappingProxyType(
    {"code": int, "name": str, "meaning": str, "action": str, "source": str, "nvidia": str}
)
_REQUIRED = ("code", "meaning", "action", "source")


@dataclass(frozen=True, slots=True, kw_only=True)
class XidEntry:
    """One Xid of the catalog."""

    code: int
    name: str  # NVIDIA's mnemonic, when it has one
    meaning: str
    action: str  # a key of ACTIONS
    source: str  # where it was read (NVIDIA's published catalog)
    nvidia: str = ""  # NVIDIA's own resolution bucket, verbatim

    @property
    def restart_helps(self) -> bool:
        return self.action in RESTART_HELPS

    @property
    def what_to_do(self) -> str:
        return ACTIONS[self.action]


@dataclass(frozen=True, slots=True, kw_only=True)
class XidLine:
    """An Xid as the driver printed it."""

    pci: str  # the GPU's PCI address, as printed
    code: int
    detail: str  # what follows the code, its `pid=..., name=...,` left out
    text: str  # the whole line from `NVRM:`
    follows: int | None = None  # the earlier Xid it says it follows (Xid 45's)

    @property
    def cause(self) -> int:
        """The Xid that says what happened: the one it follows, else its own."""
        return self.code if self.follows is None else self.follows


class XidCatalog:
    """The validated catalog: what each known Xid means and what to do."""

    def __init__(self, entries: Mapping[int, XidEntry], *, source: str = "") -> None:
        self._entries = dict(entries)
        self.source = source

    def get(self, code: int) -> XidEntry | None:
        return self._entries.get(code)

    def codes(self) -> tuple[int, ...]:
        return tuple(sorted(self._entries))


def parse_xid(text: str) -> XidLine | None:
    """The Xid a kernel line reports, or None for any other line."""
    found = _XID_LINE.search(text)
    if found is None:
        return _fallen_at_probe(text)
    code = int(found.group("xid"))
    detail = _PID.sub("", found.group("rest"), count=1).strip().rstrip(".")
    follows = int(m.group(1)) if (m := _FOLLOWS.search(detail)) else None
    return XidLine(
        pci=found.group("pci").lower(),
        code=code,
        detail=detail,
        text=text[found.start() :],
        follows=follows if follows != code else None,
    )


def _fallen_at_probe(text: str) -> XidLine | None:
    found = _FALLEN_AT_PROBE.search(text)
    if found is None:
        return None
    return XidLine(
        pci=found.group("pci").lower(),
        code=FALLEN_OFF_THE_BUS,
        detail="fallen off the bus, found by the driver's probe",
        text=" ".join(text[found.start() :].split()),
    )


def load_xid_catalog(path: Path | None = None) -> XidCatalog:
    """The catalog at `path` (the shipped one by default); ConfigError in one line naming
    the file and the key."""
    path = path or DEFAULT_XID_PATH
    data = read_toml(path, ConfigError)
    extra = sorted(set(data) - {"xid"})
    if extra:
        raise ConfigError(f"{path}: unknown top-level key(s) {extra}; only [[xid]]")
    raw = data.get("xid", [])
    if not isinstance(raw, list) or not all(isinstance(e, dict) for e in raw):
        raise ConfigError(f"{path}: 'xid' must be an array of tables [[xid]]")
    entries: dict[int, XidEntry] = {}
    for index, item in enumerate(raw):
        entry = _entry(item, f"{path}: xid[{index}]")
        if entry.code in entries:
            raise ConfigError(f"{path}: xid[{index}].code: {entry.code} listed twice")
        entries[entry.code] = entry
    return XidCatalog(entries, source=str(path))


def _entry(item: dict[str, Any], where: str) -> XidEntry:
    for key, value in item.items():
        if key not in _KEYS:
            raise ConfigError(f"{where}.{key}: unknown key (allowed: {', '.join(_KEYS)})")
        expected = _KEYS[key]
        if not isinstance(value, expected) or isinstance(value, bool):
            kind = type(value).__name__
            raise ConfigError(f"{where}.{key}: must be a {expected.__name__}, got {kind}")
    for key in _REQUIRED:
        if key not in item:
            raise ConfigError(f"{where}.{key}: missing (required)")
    if not 0 < item["code"] < 10000:
        raise ConfigError(f"{where}.code: must be between 1 and 9999, got {item['code']}")
    if item["action"] not in ACTIONS:
        raise ConfigError(
            f"{where}.action: must be one of {', '.join(ACTIONS)}, got {item['action']!r}"
        )
    if not item["source"].startswith(("https://", "http://")):
        raise ConfigError(f"{where}.source: must be the URL it was read from")
    return XidEntry(
        code=item["code"],
        name=item.get("name", ""),
        meaning=item["meaning"],
        action=item["action"],
        source=item["source"],
        nvidia=item.get("nvidia", ""),
    )
