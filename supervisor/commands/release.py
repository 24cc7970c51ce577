"""`vllm-supervisor release UNIT`: lift a halt, so the unit may start again."""

from __future__ import annotations

import argparse
import sys

from ..actions import real_name
from .gate import release_main
from .options import resolve_config


def main(args: argparse.Namespace) -> int:
    """Remove UNIT's quarantine records (under its real name, not an alias's)."""
    config = resolve_config(args)
    unit = real_name(args.unit)  # the record is under the unit's real name, not an alias
    if unit != args.unit:
        print(f"{args.unit} is an alias of {unit}", file=sys.stderr)
    return release_main(unit, config.state.runtime_dir, config.state.state_dir)
