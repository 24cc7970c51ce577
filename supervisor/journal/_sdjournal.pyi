"""Types of the libsystemd reader extension (`_sdjournal.c`)."""

def stream(
    *,
    fields: list[bytes],
    units: list[bytes],
    directory: bytes | None,
    files: list[bytes],
    follow: bool,
    cursor: str | None,
    start: str,
    match_units: bool,
    data_threshold: int,
    lines: bool,
    linger_ms: int,
) -> int:
    """Write the journal's entries to fd 1 in export format; returns the exit status."""
