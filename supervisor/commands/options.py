"""What the flags every command shares name: the config file, its directories, the usage exit."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from ..config import (
    DEFAULT_RUNTIME_DIR,
    DEFAULT_STATE_DIR,
    Config,
    load_config,
    parse_listen,
    with_units,
)

EXIT_USAGE = 2
CONFIG_ENV = "VLLM_SUPERVISOR_CONFIG"
INSTALLED_CONFIG = Path("/etc/vllm-supervisor/supervisor.toml")


def config_path(args: argparse.Namespace) -> Path | None:
    """`--config`, else $VLLM_SUPERVISOR_CONFIG, else the installed config when it exists.

    The gate runs from the served unit with no flags: it must find the daemon's directories
    from the same file the daemon reads, or a non-default `state.runtime_dir` would let every
    start through.
    """
    given = getattr(args, "config", None)
    if given is not None:
        return Path(given)
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env)
    return INSTALLED_CONFIG if INSTALLED_CONFIG.is_file() else None


def resolve_config(args: argparse.Namespace) -> Config:
    """The config file plus the one-run overrides from flags and systemd's environment."""
    config = load_config(config_path(args))
    state = config.state
    runtime_dir = getattr(args, "runtime_dir", None) or _from_env(
        "RUNTIME_DIRECTORY", state.runtime_dir, DEFAULT_RUNTIME_DIR
    )
    state_dir = getattr(args, "state_dir", None) or _from_env(
        "STATE_DIRECTORY", state.state_dir, DEFAULT_STATE_DIR
    )
    state = dataclasses.replace(state, runtime_dir=runtime_dir, state_dir=state_dir)
    journal = config.journal
    if getattr(args, "directory", None):
        journal = dataclasses.replace(journal, directory=args.directory)
    metrics = config.metrics
    if getattr(args, "metrics_listen", None):
        parse_listen(args.metrics_listen)
        metrics = dataclasses.replace(metrics, listen=args.metrics_listen)
    config = dataclasses.replace(
        config,
        state=state,
        journal=journal,
        metrics=metrics,
        dry_run=config.dry_run or bool(getattr(args, "dry_run", False)),
    )
    # `run --unit` adds units; for gate/release/preflight `unit` is the one unit they act on.
    extra = args.unit if isinstance(getattr(args, "unit", None), list) else []
    return with_units(config, extra)


def _from_env(variable: str, configured: Path, default: Path) -> Path:
    # systemd's RuntimeDirectory=/StateDirectory= set these; they win over a default, not
    # over a value an operator wrote into the config.
    value = os.environ.get(variable)
    if configured == default and value:
        return Path(value.split(":")[0])
    return configured
