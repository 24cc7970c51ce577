"""Shared fixtures: polling with a deadline, and real journal directories (journal-remote)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from slack_server import SlackServer

from vllm_supervisor.journal.writer import JournalWriter


def wait_for(condition: Callable[[], object], *, timeout: float = 20.0, what: str = "") -> None:
    """Poll `condition` until it is true or the deadline passes (then fail, naming `what`)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    pytest.fail(f"timed out after {timeout} s waiting for {what or condition}")


async def poll(
    condition: Callable[[], object],
    *,
    within: float = 10.0,
    each: Callable[[], object] | None = None,
) -> None:
    """Await `condition` with a deadline, calling `each` between tries (e.g. a journal nudge)."""
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within}s")
        if each is not None:
            each()
        await asyncio.sleep(0.005)


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


@pytest.fixture(autouse=True)
def _structlog_restored() -> Iterator[None]:
    """A test that runs `cli.main` in-process configures logging onto the stream pytest
    captured for it, which is closed after the test: later tests must not log into it."""
    import structlog

    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture(name="slack")
def _slack() -> Iterator[SlackServer]:
    """A Slack webhook stand-in on loopback (tests/slack_server.py)."""
    server = SlackServer()
    server.start()
    yield server
    server.stop()
