"""`vllm-supervisor history`: every invocation the daemon classified, from its state database."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..store import Store
from ..story import NO_ROOT_CAUSE, shown, told
from ..util.text import for_terminal, visible
from .options import resolve_config


def main(args: argparse.Namespace) -> int:
    """What the daemon classified, oldest first, as text or JSON."""
    config = resolve_config(args)
    path = config.state.state_dir
    store = Store.read_only(path)
    try:
        items = store.history(args.unit)
    finally:
        store.close()
    if args.format == "json":
        print(json.dumps({"invocations": items}, indent=2))
        return 0
    if not items:
        print(for_terminal(f"no classified invocation in {path}"))
    for item in items:
        print(for_terminal(_history_text(item)), end="")
    return 0


def _history_text(item: dict[str, Any]) -> str:
    """One recorded invocation for a person; every recorded value is shown `visible`."""
    verdict, decision = _mapping(item.get("verdict")), _mapping(item.get("decision"))
    text = (
        f"{_shown(item.get('time'))}  {_shown(item.get('unit'))}  "
        f"{_shown(item.get('invocation_id') or '-')}  {_shown(verdict.get('severity')):9} "
        f"{_shown(verdict.get('signature') or '-'):32} "
        f"notified={item.get('notified')}{'  engine hung' if item.get('hung') else ''}\n"
        f"    {_shown(told(_text(decision.get('action')), _text(item.get('taken'))))}\n"
        f"    {_shown(verdict.get('root_cause') or NO_ROOT_CAUSE)}\n"
    )
    drift = item.get("drift")
    if isinstance(drift, list) and drift:
        text += f"    changed since the last good start: {_shown('; '.join(map(str, drift)))}\n"
    return text


def _shown(value: object) -> str:
    return visible(shown(value))


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _mapping(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
