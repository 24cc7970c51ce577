"""JSON read from outside: one error type for every text that is not a JSON value.

`json.loads` raises RecursionError, not ValueError, for arrays or objects nested past the
interpreter's recursion limit: 4 KiB of `[` is enough. Every reader of outside JSON (a
quarantine record, a gate's request, a saved journal, an HTTP reply, a state database row)
guards against ValueError, so it reads through `loads`.
"""

from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes | bytearray) -> Any:
    """The JSON value of `text`; ValueError when it holds none (nested too deep included)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def whole_number(value: object, default: int = 0) -> int:
    """`value` read back from JSON (a record, a reply) as an int, or `default` for anything
    else: a bool is JSON's true/false, not a count."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default
