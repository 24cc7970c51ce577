"""`vllm-supervisor check-config [PATH]`: load the config, its signature table and the engine
files, and report what was found. As the daemon's `ExecReload=`, a file the reload would refuse
fails it here."""

from __future__ import annotations

import argparse
import contextlib
import sys

from ..classify import load_table
from ..config import check_webhook, load_config
from ..engines.profiles import load_engines
from .options import config_path
from .setup import alias_note, ask_systemd, inline_webhook_note, missing_drop_ins, ungated_note


def main(args: argparse.Namespace) -> int:
    """0 when the config, its table and the engine files load; warnings on standard error."""
    path = args.path or config_path(argparse.Namespace())
    config = load_config(path)
    table = load_table(config)
    engines = load_engines()
    # As the daemon's ExecReload= it runs as the daemon's user: what that user may not read
    # (the webhook's credential file, a unit directory) is a warning, not a refused reload.
    try:
        check_webhook(config.slack)
    except OSError as exc:
        print(f"warning: the webhook URL was not checked: {exc.strerror}", file=sys.stderr)
    if path is not None:
        with contextlib.suppress(OSError):  # read a moment ago: a stat that fails says nothing
            if (note := inline_webhook_note(config, path)) is not None:
                print(f"warning: {note}", file=sys.stderr)
    units = ", ".join(u.name for u in config.units) or "none (pass --unit to run)"
    print(
        f"config ok: units: {units}; {len(table.signatures)} signatures; engines: "
        f"{', '.join(engines.ids)}"
    )
    # Where systemd cannot be asked (no bus here), names are checked as configured and the
    # gate by its drop-in file; where it can, by what systemd loaded (a gate written in the unit
    # file counts, one a later drop-in emptied does not).
    facts = ask_systemd([u.name for u in config.units])
    for alias, real in facts.aliases.items():
        print(f"warning: {alias_note(alias, real)}", file=sys.stderr)
    if facts.trouble is None:
        for unit in facts.ungated:
            print(f"warning: {ungated_note(unit)}", file=sys.stderr)
        return 0
    try:
        missing = missing_drop_ins(config, real_names=facts.aliases)
    except OSError as exc:
        print(f"warning: the gate drop-ins were not checked: {exc.strerror}", file=sys.stderr)
        missing = []
    for unit in missing:
        print(
            f"warning: {unit} has no gate drop-in ({unit}.d/10-vllm-supervisor.conf): a halt "
            "stops it but nothing refuses its next start; run `vllm-supervisor setup`",
            file=sys.stderr,
        )
    return 0
