"""What the daemon and the commands load from a config: its signature table, and what a reload
(SIGHUP) can and cannot change while running."""

from __future__ import annotations

import dataclasses

from supervisor.classify.signatures import SignatureTable, load_signature_table
from supervisor.config import Config
from supervisor.errors import ConfigError, SupervisorError

# Read once at start-up (the reader child, the state database, the listening sockets, the Slack
# client, the tracker's caps): a change needs a restart of the daemon.
RESTART_ONLY = ("journal", "tracker", "state", "slack", "metrics", "systemd", "gate", "drift")


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


def restart_only_changes(old: Config, new: Config) -> list[str]:
    """The keys that differ between `old` and `new` but only take effect after a restart."""
    changed: list[str] = []
    for section in RESTART_ONLY:
        before, after = getattr(old, section), getattr(new, section)
        for field in dataclasses.fields(before):
            if getattr(before, field.name) != getattr(after, field.name):
                changed.append(f"{section}.{field.name}")
    return changed
