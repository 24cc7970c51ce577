"""Which GPUs a unit runs on, as the driver names them: PCI addresses, or None when unknown.

The kernel's Xid line names a GPU by its PCI address (`NVRM: Xid (PCI:0000:3b:00): 79`); a unit
names its GPUs in `CUDA_VISIBLE_DEVICES` (its Environment=), by UUID (`GPU-2b7e...`) or by
CUDA index. The driver's own table, `/proc/driver/nvidia/gpus/<pci>/information`, gives each
GPU's UUID and bus location. A UUID maps for sure. An index maps only when CUDA numbers the GPUs
in PCI bus order: `CUDA_DEVICE_ORDER=PCI_BUS_ID`, or every GPU the same model (CUDA's default
"fastest first" cannot tell identical GPUs apart by speed). Anything else (MIG instances, a
mixed host with the default order, no variable, an unreadable table) is None: the unit may run
on any GPU of the host, and an Xid of any of them may be its cause.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
MAX_GPUS = 64  # GPUs of one host read from the driver's table, at most
_PCI = re.compile(r"^(?:[0-9a-f]{4,8}:)?[0-9a-f]{2}:[0-9a-f]{2}(?:\.[0-7])?$", re.IGNORECASE)
_UUID = re.compile(r"^GPU-[0-9a-f-]{8,64}$", re.IGNORECASE)


def device_key(pci: str) -> str:
    """A PCI address as both the driver's table and its Xid lines agree on: domain, bus and
    device, lower case, no function (`0000:3B:00.0` and `3b:00` are `0000:3b:00`)."""
    text = pci.strip().lower().split(".", 1)[0]
    parts = text.split(":")
    if len(parts) == 2:
        parts = ["0000", *parts]
    try:
        domain, bus, device = parts[-3:]
        return f"{int(domain, 16):04x}:{bus}:{device}"
    except ValueError:
        return text  # not an address: compared as written


def driver_gpus(root: Path = NVIDIA_GPUS) -> dict[str, dict[str, str]]:
    """The driver's GPUs: device key -> its `information` fields (Model, GPU UUID, ...); empty
    when the table cannot be read (no driver, a container without /proc/driver)."""
    found: dict[str, dict[str, str]] = {}
    try:
        entries = sorted(root.iterdir())[:MAX_GPUS]
    except OSError:
        return {}
    for entry in entries:
        if not _PCI.match(entry.name):
            continue
        try:
            text = (entry / "information").read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        fields = {}
        for line in text.splitlines()[:64]:
            name, sep, value = line.partition(":")
            if sep:
                fields[name.strip()] = value.strip()
        found[device_key(entry.name)] = fields
    return found


def unit_gpus(
    environment: Sequence[str], gpus: Mapping[str, Mapping[str, str]]
) -> frozenset[str] | None:
    """The device keys of the GPUs a unit with these Environment= assignments sees; None when
    that cannot be known for sure (see the module's note)."""
    assigned = _assignments(environment)
    visible = assigned.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not gpus:
        return None
    names = [name.strip() for name in visible.split(",") if name.strip()]
    if not names or any(name.startswith("-") for name in names):
        return None  # no GPU at all, or CUDA's "stop here": nothing to restrict by
    by_uuid = {fields.get("GPU UUID", "").lower(): key for key, fields in gpus.items()}
    if all(_UUID.match(name) for name in names):
        keys = [by_uuid.get(name.lower()) for name in names]
        return None if None in keys else frozenset(k for k in keys if k is not None)
    if not all(name.isdigit() for name in names):
        return None  # MIG instances, a mix: not mapped
    in_bus_order = assigned.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" or (
        len({fields.get("Model") for fields in gpus.values()}) == 1
    )
    if not in_bus_order:
        return None
    ordered = sorted(gpus)
    indexes = [int(name) for name in names]
    if any(index >= len(ordered) for index in indexes):
        return None
    return frozenset(ordered[index] for index in indexes)


def gpus_asked_about(
    environment: Sequence[str], gpus: Mapping[str, Mapping[str, str]], pci: str
) -> frozenset[str] | None:
    """`unit_gpus`, asked about the GPU `pci` an Xid named: None as well when that GPU is not
    in the driver's table now (one that fell off the bus may leave it, and every index after it
    would map to the wrong GPU)."""
    return unit_gpus(environment, gpus) if device_key(pci) in gpus else None


def _assignments(environment: Sequence[str]) -> dict[str, str]:
    """Environment= assignments as a mapping (the last of a name wins, as systemd's does)."""
    found: dict[str, str] = {}
    for assignment in environment:
        name, sep, value = assignment.partition("=")
        if sep:
            found[name] = value
    return found
