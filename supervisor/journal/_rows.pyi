"""Types of the rows' parser extension (`_rows.c`)."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

def configure(
    cls: type,
    slot_names: Sequence[str],
    lifecycle_names: Sequence[str],
    message_text: Callable[[bytes, int], str],
    empty: Mapping[str, str],
) -> None:
    """Set the entry class and its slots (once)."""

def parse(
    buf: bytes, max_chars: int
) -> tuple[list[Any], bytes | None, bytes | None, int, int, int]:
    """Parse complete rows: (entries, first, last, consumed, invalid, synced)."""
