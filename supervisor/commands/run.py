"""`vllm-supervisor run`: the daemon, until SIGTERM/SIGINT; SIGHUP reloads the config and its
table."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from ..app import run_daemon
from .options import EXIT_USAGE, resolve_config


def main(args: argparse.Namespace) -> int:
    """Follow the journal of the configured units and act on their crashes."""
    config = resolve_config(args)
    if not config.units:
        print(
            "vllm-supervisor: no unit to supervise: pass --unit U or list [[unit]] in the config",
            file=sys.stderr,
        )
        return EXIT_USAGE

    async def serve() -> None:
        stop, reload = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGHUP, reload.set)
        await run_daemon(config, stop, reload, reload_config=lambda: resolve_config(args))

    asyncio.run(serve())
    return 0
