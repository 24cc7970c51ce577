"""The signature table a config names, checked against the units that use its sets."""

from __future__ import annotations

from ..config import Config
from ..errors import ConfigError, SupervisorError
from .signatures import SignatureTable, load_signature_table


def load_table(config: Config) -> SignatureTable:
    """The signature table the config names (the shipped one by default).

    Every unit's `signature_sets` is checked here, at load, so a typo stops the daemon with
    one line instead of failing at the first crash it classifies.
    """
    table = load_signature_table(list(config.signatures.paths) or None)
    for index, unit in enumerate(config.units):
        if unit.signature_sets:
            try:
                table.subset(unit.signature_sets)
            except SupervisorError as exc:
                raise ConfigError(f"unit[{index}].signature_sets: {exc}") from exc
    return table
