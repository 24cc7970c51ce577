"""Shared fixtures: polling with a deadline, and real journal directories (journal-remote)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from supervisor.journal.writer import JournalWriter


def wait_for(condition: Callable[[], object], *, timeout: float = 20.0, what: str = "") -> None:
    """Poll `condition` until it is true or the deadline passes (then fail, naming `what`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    pytest.fail(f"timed out after {timeout} s waiting for {what or condition}")


@pytest.fixture(name="journal_dir")
def _journal_dir(tmp_path: Path) -> Path:
    path = tmp_path / "journal"
    path.mkdir()
    return path


@pytest.fixture(name="writer")
def _writer(journal_dir: Path) -> Iterator[JournalWriter]:
    writer = JournalWriter(journal_dir)
    yield writer
    writer.close()
