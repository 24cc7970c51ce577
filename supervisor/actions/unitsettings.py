"""What systemd has loaded for a unit: the part of its config a halt's fingerprint keeps.

Read over D-Bus, for the daemon at halt time and for the gate before a start: the properties
are what systemd will run (after the last `daemon-reload`), which the unit files on disk need
not be. One LoadUnit, then the few properties asked at once (SystemdClient.properties).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from ..environment.fingerprint import UnitSettings
from ..environment.gpus import NVIDIA_GPUS, driver_gpus, gpus_asked_about
from ..environment.unit_view import UnitView, paths_of
from ..errors import SystemdError
from .systemd import SERVICE_IFACE, UNIT_IFACE, SystemdClient, ask_once

T = TypeVar("T")
_UNIT_PROPERTIES = ("LoadState", "FragmentPath", "DropInPaths", "NeedDaemonReload")
_SERVICE_PROPERTIES = ("ExecStart", "Environment", "EnvironmentFiles")


async def unit_settings(client: SystemdClient, unit: str) -> UnitSettings | None:
    """The unit's loaded settings; None for a unit that is not a service or not loaded.
    Raises SystemdError."""
    if not unit.endswith(".service"):
        return None
    asked = [(UNIT_IFACE, name) for name in _UNIT_PROPERTIES]
    asked += [(SERVICE_IFACE, name) for name in _SERVICE_PROPERTIES]
    props = await client.properties(unit, asked)
    if props["LoadState"] != "loaded":
        return None
    try:
        return UnitSettings(
            exec_start=tuple(
                (str(command[0]), *map(str, command[1])) for command in props["ExecStart"]
            ),
            environment=tuple(map(str, props["Environment"])),
            environment_files=tuple(str(entry[0]) for entry in props["EnvironmentFiles"]),
            unit_files=tuple(
                path
                for path in (str(props["FragmentPath"]), *map(str, props["DropInPaths"]))
                if path
            ),
            needs_reload=bool(props["NeedDaemonReload"]),
        )
    except (TypeError, IndexError, KeyError) as exc:
        raise SystemdError(
            f"{unit}: unexpected property types: {exc}", reason="dbus_error", retryable=False
        ) from exc


GPUS_TIMEOUT_S = 0.5  # a crash near an Xid waits this long at most to learn the unit's GPUs


async def unit_gpus_of(
    client: SystemdClient | None, unit: str, pci: str, *, gpus_root: Path = NVIDIA_GPUS
) -> frozenset[str] | None:
    """The GPUs `unit` sees (supervisor.environment.gpus: device keys), asked about the GPU
    `pci` an Xid named; None when that cannot be known: no systemd, no answer in time, no
    CUDA_VISIBLE_DEVICES it can map, or `pci` not in the driver's table now. Never raises:
    the Xid then joins whatever GPU logged it, as before."""
    if client is None:
        return None
    try:
        async with asyncio.timeout(GPUS_TIMEOUT_S):
            settings = await unit_settings(client, unit)
            # The driver may be in recovery right now: its table is read within the bound too.
            table = await asyncio.to_thread(driver_gpus, gpus_root)
    except (SystemdError, TimeoutError):
        return None
    return None if settings is None else gpus_asked_about(settings.environment, table, pci)


def ask_unit_settings(unit: str, *, timeout_s: float) -> UnitSettings | None:
    """For the gate (a one-shot process): the unit's loaded settings, or None when systemd
    cannot be asked or does not answer in time."""
    return _asked(unit_settings, unit, timeout_s)


def _asked(
    read: Callable[[SystemdClient, str], Awaitable[T | None]], unit: str, timeout_s: float
) -> T | None:
    """`read(client, unit)` on a connection of its own, bounded; None when systemd cannot be
    asked or does not answer in time."""

    async def question(client: SystemdClient) -> T | None:
        async with asyncio.timeout(timeout_s):
            return await read(client, unit)

    try:
        return ask_once(question, timeout_s=timeout_s)
    except (SystemdError, OSError, TimeoutError):
        return None


_VIEW_PROPERTIES = (
    "User",
    "Group",
    "SupplementaryGroups",
    "DynamicUser",
    "RootDirectory",
    "PrivateTmp",
    "ProtectHome",
    "BindPaths",
    "BindReadOnlyPaths",
    "InaccessiblePaths",
    "TemporaryFileSystem",
)


async def unit_view(client: SystemdClient, unit: str) -> UnitView | None:
    """How the unit's processes see the file system (supervisor.environment.unit_view); None
    for a unit that is not a loaded service. Raises SystemdError."""
    if not unit.endswith(".service"):
        return None
    asked = [(UNIT_IFACE, "LoadState"), *((SERVICE_IFACE, name) for name in _VIEW_PROPERTIES)]
    props = await client.properties(unit, asked)
    if props["LoadState"] != "loaded":
        return None
    try:
        binds = [*props["BindPaths"], *props["BindReadOnlyPaths"]]  # a(ssbt): source, dest, ...
        return UnitView(
            user=str(props["User"]),
            group=str(props["Group"]),
            supplementary=tuple(map(str, props["SupplementaryGroups"])),
            dynamic_user=bool(props["DynamicUser"]),
            root_directory=str(props["RootDirectory"]),
            private_tmp=bool(props["PrivateTmp"]),
            protect_home=str(props["ProtectHome"]),
            binds=tuple((str(bind[0]), str(bind[1])) for bind in binds),
            hidden=(
                *paths_of([str(p) for p in props["InaccessiblePaths"]]),
                *(str(mount[0]) for mount in props["TemporaryFileSystem"]),
            ),
        )
    except (TypeError, IndexError, KeyError) as exc:
        raise SystemdError(
            f"{unit}: unexpected property types: {exc}", reason="dbus_error", retryable=False
        ) from exc


def ask_unit_view(unit: str, *, timeout_s: float) -> UnitView | None:
    """For the gate and the recheck: how `unit` sees the file system, or None when systemd
    cannot be asked, does not answer in time, or knows no such service."""
    return _asked(unit_view, unit, timeout_s)
