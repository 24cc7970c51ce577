"""`python -m vllm_supervisor.journal.native_child`: the libsystemd reader, as a child process.

Only the parent (`supervisor.journal.reader`) runs this. It writes the journal to stdout in
`journalctl -o export` framing, restricted to the fields the pipeline reads, and exits with
journalctl's messages on stderr ("Failed to seek to cursor: ...") when it cannot go on. Crashes
of libsystemd during journal rotation (SIGBUS before systemd 255) end this process only; the
parent restarts it from the last cursor it received.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The child's command line (built by `reader.native_argv`)."""
    parser = argparse.ArgumentParser(prog="python -m vllm_supervisor.journal.native_child")
    parser.add_argument("--directory", type=Path)
    parser.add_argument("--file", type=Path, action="append", default=[])
    parser.add_argument("--unit", action="append", default=[])
    parser.add_argument("--field", action="append", default=[])
    parser.add_argument("--follow", action="store_true")
    parser.add_argument("--cursor")
    parser.add_argument("--start", choices=("head", "tail", "last"), default="head")
    parser.add_argument("--data-threshold", type=int, default=0)
    parser.add_argument(
        "--linger-ms",
        type=int,
        default=0,
        help="when busy, batch changes for this long before reading (0: read at each change)",
    )
    parser.add_argument(
        "--lines", action="store_true", help="the lean framing (export.LineParser) for the daemon"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Stream the journal to fd 1; journalctl-like exit status."""
    from . import _sdjournal

    args = parse_args(sys.argv[1:] if argv is None else argv)
    sys.stdout.flush()
    status: int = _sdjournal.stream(
        fields=[f.encode() for f in args.field],
        units=[u.encode() for u in args.unit],
        directory=os.fsencode(args.directory) if args.directory is not None else None,
        files=[os.fsencode(f) for f in args.file],
        follow=args.follow,
        cursor=args.cursor,
        start=args.start,
        match_units=bool(args.unit),
        data_threshold=args.data_threshold,
        lines=args.lines,
        linger_ms=args.linger_ms,
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
