"""The signature table a config names, checked against the units that use its sets."""

from __future__ import annotations

from pathlib import Path

from ..config import Config
from ..errors import ConfigError, SupervisorError
from .signatures import DEFAULT_SIGNATURE_DIR, SignatureTable, load_signature_table

CACHE_DIR = "signature-cache"  # under the runtime directory


def table_paths(config: Config) -> list[Path] | None:
    """The files and directories of the config's table: its `paths` (else the shipped
    table), then each `local` one that exists (this host's own, proposed signatures)."""
    signatures = config.signatures
    local = [path for path in signatures.local or () if path.exists()]
    if not local:
        return list(signatures.paths) or None
    return [*(signatures.paths or (DEFAULT_SIGNATURE_DIR,)), *local]


def load_table(config: Config, *, cached: bool = False) -> SignatureTable:
    """The signature table the config names (the shipped one by default).

    Every unit's `signature_sets` is checked here, at load, so a typo stops the daemon with
    one line instead of failing at the first crash it classifies. `cached` (the daemon's
    start and reloads): the validated table is kept in the runtime directory for the next load
    of the same files (`table_cache`); the commands that only read leave no files behind.
    """
    cache_dir = config.state.runtime_dir / CACHE_DIR if cached else None
    table = load_signature_table(table_paths(config), cache_dir=cache_dir)
    for index, unit in enumerate(config.units):
        if unit.signature_sets:
            try:
                table.subset(unit.signature_sets)
            except SupervisorError as exc:
                raise ConfigError(f"unit[{index}].signature_sets: {exc}") from exc
    return table
