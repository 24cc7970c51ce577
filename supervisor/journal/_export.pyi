"""Types of the export format's parser extension (`_export.c`)."""

from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

def configure(
    cls: type,
    slot_names: Sequence[str],
    lifecycle_fields: Sequence[bytes],
    message_text: Callable[[bytes, int], str],
    field_int: Callable[[bytes], int | None],
    empty: Mapping[str, str],
) -> None:
    """Set the entry class, its slots and the helpers (once)."""

def parse(
    buf: bytes, max_chars: int, max_length: int, units: Set[bytes] | None
) -> tuple[list[Any], bytes | None, bytes | None, int, int, int]:
    """Parse complete entries: (entries, first, last, consumed, invalid, parsed)."""
