"""`vllm-supervisor signatures list|test`: the signature table, and which entry matches a log."""

from __future__ import annotations

import argparse

from ..classify import load_table
from ..config import load_config
from ..util.text import for_terminal
from .options import config_path
from .sigtest import signatures_test


def main(args: argparse.Namespace) -> int:
    """`list`: one line per signature; `test FILE`: the verdict, then which signatures matched
    which line and why."""
    table = load_table(load_config(config_path(args)))
    if args.signatures_command == "test":
        return signatures_test(args.file, table)
    for sig in table.signatures:
        line = f"{sig.id:40} {sig.severity.value:9} {sig.kind:7} {sig.domain:12} {sig.title}"
        print(for_terminal(line))
    return 0
