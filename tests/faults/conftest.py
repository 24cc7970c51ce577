"""Fixtures of the fault-injection tests: a loopback Slack, supervisor children, cleanup."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from faults.harness import Supervisor, is_reader, write_config


def pytest_configure(config: pytest.Config) -> None:
    """Register the soak marker here (the shared pyproject is not ours to edit)."""
    config.addinivalue_line("markers", "soak: compressed soak test (minutes, not seconds)")


@pytest.fixture(name="supervisors")
def _supervisors() -> Iterator[list[Supervisor]]:
    started: list[Supervisor] = []
    yield started
    for sup in started:
        sup.stop_quietly()
        for pid in sup.orphans:
            # journalctl children of a SIGKILLed supervisor outlive it; they are ours to end.
            # (The native reader asks the kernel to end it with its parent: PR_SET_PDEATHSIG.)
            if is_reader(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


SupervisorFactory = Callable[..., Supervisor]


@pytest.fixture(name="make_supervisor")
def _make_supervisor(tmp_path: Path, supervisors: list[Supervisor]) -> SupervisorFactory:
    def make(
        *,
        slack_url: str | None = None,
        extra: str = "",
        state: str = "",
        reader: str = "auto",
        slack_timeout_s: float = 2.0,
    ) -> Supervisor:
        config = write_config(
            tmp_path,
            slack_url=slack_url,
            extra=extra,
            state=state,
            reader=reader,
            slack_timeout_s=slack_timeout_s,
        )
        sup = Supervisor(tmp_path, config)
        supervisors.append(sup)
        return sup

    return make
