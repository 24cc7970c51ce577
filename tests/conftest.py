"""Shared fixtures: polling with a deadline, and real journal directories (journal-remote).

The suite tests the checkout it runs in: `pytest_configure` refuses to start when
`vllm_supervisor` is imported from anywhere else (an editable install of another clone, an
installed wheel), since every test would then pass or fail on that other code.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from packaged import Built, build
from slack_server import SlackServer

import vllm_supervisor
from vllm_supervisor.journal.writer import JournalWriter

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    """Stop before collecting when the package under test is not this checkout's."""
    imported = Path(vllm_supervisor.__file__).resolve().parent
    if imported != REPO / "supervisor":
        raise pytest.UsageError(
            f"vllm_supervisor is imported from {imported}, not from this checkout's"
            f" {REPO / 'supervisor'}: run ./scripts/install-deps in {REPO}, then ./scripts/test"
        )


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


@pytest.fixture(scope="session", name="built")
def _built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """This checkout built once per run with `python -m build`: the sdist and its wheel."""
    return build(tmp_path_factory.mktemp("build"))
