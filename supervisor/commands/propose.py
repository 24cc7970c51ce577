"""`vllm-supervisor signatures propose UNIT [INVOCATION] [--write [FILE]]`.

From the daemon's record of a crash (the unit's last unknown crash, or the invocation named),
a ready-to-review `[[signature]]` (supervisor.classify.proposal): printed, or with `--write`
added to this host's own signatures (`[signatures] local`, by default `signatures.d/` beside
the config: `signatures.d/proposed.toml`), after the whole table loads with it. A reload of
the daemon (`systemctl reload vllm-supervisor`) then halts the same crash at its first.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from ..classify import (
    DEFAULT_SIGNATURE_DIR,
    Proposal,
    Refused,
    load_signature_table,
    propose,
    table_paths,
)
from ..config import Config
from ..errors import SupervisorError
from ..store import Store
from ..util.text import for_terminal
from .options import resolve_config

PROPOSED_FILE = "proposed.toml"


def main(args: argparse.Namespace) -> int:
    config = resolve_config(args)
    write = args.write
    if write == "":  # `--write` alone: this host's own signatures
        write = _default_file(config)
    return propose_main(
        config, args.unit, args.invocation, write=None if write is None else Path(write)
    )


def propose_main(
    config: Config,
    unit: str,
    invocation: str | None = None,
    *,
    write: Path | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """0 with the proposal printed or written; 1 (one line) when none can be made."""
    out, err = out or sys.stdout, err or sys.stderr
    try:
        store = Store.read_only(config.state.state_dir)
    except SupervisorError as exc:
        print(for_terminal(f"signatures propose: {exc}"), file=err)
        return 1
    try:
        items = store.history(unit)
    finally:
        store.close()
    try:
        item = _chosen(items, unit, invocation)
        proposal = propose(item)
        if write is not None:
            _write(config, write, proposal)
    except (Refused, SupervisorError) as exc:
        print(for_terminal(f"signatures propose: {exc}"), file=err)
        return 1
    if write is None:
        out.write(proposal.toml)
    else:
        print(for_terminal(f"wrote signature {proposal.id} to {write}"), file=out)
        print("apply it with: systemctl reload vllm-supervisor", file=out)
        named = [u for u in config.units if u.name == unit and u.signature_sets]
        if named and write.stem not in named[0].signature_sets:
            print(
                for_terminal(
                    f"note: {unit} has signature_sets: add {write.stem!r} to them, or it is "
                    "not matched for this unit"
                ),
                file=out,
            )
    return 0


def _chosen(items: Sequence[dict[str, Any]], unit: str, invocation: str | None) -> dict[str, Any]:
    """The named invocation, else the unit's last crash no signature knew."""
    if invocation is not None:
        for item in items:
            if item.get("invocation_id") == invocation:
                return item
        raise Refused(
            f"{unit}: no recorded invocation {invocation} (see `vllm-supervisor history`)"
        )
    for recorded in reversed(items):
        verdict, decision = recorded.get("verdict"), recorded.get("decision")
        if not isinstance(verdict, dict) or not isinstance(decision, dict):
            continue
        crashed = decision.get("action") not in (None, "observe")
        if crashed and verdict.get("signature") is None and verdict.get("root_cause"):
            return dict(recorded)
    raise Refused(f"{unit}: no recorded crash that no signature knows")


def _default_file(config: Config) -> str:
    local = config.signatures.local
    if not local:
        raise SystemExit(
            "signatures propose: --write needs a FILE: no config file, so no signatures.d"
        )
    return str(local[0] / PROPOSED_FILE)


def _write(config: Config, path: Path, proposal: Proposal) -> None:
    """Add the proposal to `path` once the whole table (with it) loads; atomically."""
    try:
        before = path.read_text(encoding="utf-8") if path.exists() else ""
    except (OSError, UnicodeDecodeError) as exc:
        raise Refused(f"{path}: cannot read: {exc}") from exc
    text = (before.rstrip("\n") + "\n\n" if before.strip() else "") + proposal.toml
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(text, encoding="utf-8")
        partial.chmod(0o644)  # the daemon's user reads it
        paths = [p for p in (table_paths(config) or []) if p != path and p != path.parent]
        load_signature_table([*(paths or [DEFAULT_SIGNATURE_DIR]), partial, *_siblings(path)])
        partial.replace(path)
    except OSError as exc:
        raise Refused(f"{path}: cannot write: {exc.strerror}") from exc
    finally:
        partial.unlink(missing_ok=True)


def _siblings(path: Path) -> list[Path]:
    """The other signature files of the local directory `path` is in (loaded beside it)."""
    if not path.parent.is_dir():
        return []
    return [p for p in sorted(path.parent.glob("*.toml")) if p != path]
