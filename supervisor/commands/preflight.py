"""`vllm-supervisor preflight UNIT`: catch a deterministic crash before the model loads.

Run as `ExecStartPre=` (exit 1 fails the start), a failure prints the same signature id, title
and remediation the crash would have. The checks are the stages' (actions.preflight).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from ..actions import ask_once, quarantine_dirs, run_preflight
from ..classify import SignatureTable, load_table
from ..environment import interpreter_from_exec_start, serving_port
from ..errors import SupervisorError, SystemdError
from .options import resolve_config

EXIT_OK = 0
EXIT_FAILED = 1


def main(args: argparse.Namespace) -> int:
    """The unit's interpreter and port: the flags, else the config, else its ExecStart=."""
    config = resolve_config(args)
    unit = config.unit(args.unit)
    try:
        table: SignatureTable | None = load_table(config)
    except SupervisorError as exc:
        # A broken table must not fail the served unit's start (preflight may run as its
        # ExecStartPre=): say so, and check in the words of the shipped table.
        print(f"vllm-supervisor: preflight without the signature table: {exc}", file=sys.stderr)
        table = None
    return preflight_main(
        args.unit,
        python=args.python or (Path(unit.python) if unit.python else None),
        port=args.port if args.port is not None else unit.port,
        runtime_dir=config.state.runtime_dir,
        state_dir=config.state.state_dir,
        output_format=args.format,
        table=table,
    )


def preflight_main(
    unit: str,
    *,
    python: Path | None,
    port: int | None,
    runtime_dir: Path,
    state_dir: Path,
    output_format: str,
    exec_start: Callable[[str], list[str] | None] | None = None,
    table: SignatureTable | None = None,
    out: TextIO | None = None,
) -> int:
    """0 when every check passes, 1 otherwise. Without a python or a port, both are read from
    the unit's ExecStart= (systemd over D-Bus); a unit with no Python (TGI's launcher) skips the
    package checks. `table` None: the shipped table's words."""
    if python is None or port is None:
        argv = (exec_start or exec_start_argv)(unit)
        if argv is not None:
            python = python or interpreter_from_exec_start(argv)
            port = port if port is not None else serving_port(argv)
    dirs = quarantine_dirs(runtime_dir, state_dir)
    report = run_preflight(
        python=python, port=port, quarantine_dir=dirs, unit=unit, table=table, state_dir=state_dir
    )
    json_text = json.dumps(report.to_json(), indent=2) + "\n"
    (out or sys.stdout).write(json_text if output_format == "json" else report.render_text())
    return EXIT_OK if report.ok else EXIT_FAILED


def exec_start_argv(unit: str, *, timeout_s: float = 2.0) -> list[str] | None:
    """The argv of a unit's (first) ExecStart=, as systemd reports it over D-Bus; None when
    systemd cannot say."""
    try:
        return ask_once(lambda client: client.exec_start(unit), timeout_s=timeout_s) or None
    except (SystemdError, OSError, TimeoutError):
        return None
