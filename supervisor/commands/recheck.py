"""`vllm-supervisor recheck UNIT`: start a unit whose halt's own cause is gone (a port's holder
left, a missing path appeared); run as root by the systemd timer its gate armed."""

from __future__ import annotations

import argparse
import sys

from ..config import Config, load_config
from ..errors import SupervisorError
from .gate import recheck_main
from .options import config_path


def main(args: argparse.Namespace) -> int:
    """Check UNIT's halt now: lift it and start the unit once its cause is gone. The gate
    names the directories on the timer's command line: a config that does not load changes
    nothing here."""
    try:
        state = load_config(config_path(args)).state
    except SupervisorError as exc:
        print(f"{args.unit}: the supervisor's config does not load ({exc})", file=sys.stderr)
        state = Config().state
    runtime_dir = args.runtime_dir or state.runtime_dir
    state_dir = args.state_dir or state.state_dir
    return recheck_main(args.unit, runtime_dir, state_dir)
