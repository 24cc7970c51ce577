"""The daemon supervising hundreds of units, on real journal files written by journal-remote.

Every configured unit is followed and each crash decided, whatever the count: the reader child
once took at most 64 `--unit` options, and with 100 it exited at start, was restarted forever,
and nothing was read or decided while `check-config` said "config ok".
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from pathlib import Path

import pytest
from conftest import poll

from vllm_supervisor.app import compose_daemon
from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.demo import demo_config, seed_lines
from vllm_supervisor.config import Config, UnitConfig
from vllm_supervisor.journal.writer import (
    FieldValue,
    JournalWriter,
    crashed_invocation,
    service_lines,
    start_entries,
)
from vllm_supervisor.store import Store
from vllm_supervisor.telemetry.metrics import Metrics, new_registry


def unit_name(number: int) -> str:
    """The n-th configured unit (1-based, as the issue counts them)."""
    return f"serve-{number:04d}.service"


def crash_journal(units: int, crashing: list[int]) -> list[dict[str, FieldValue]]:
    """The other units start and log a line each; then the `crashing` ones crash on the seed
    log, after all of them, as a journal holding every unit's entries before theirs."""
    entries: list[dict[str, FieldValue]] = []
    for number in range(1, units + 1):
        if number in crashing:
            continue
        inv = uuid.uuid4().hex
        entries += start_entries(unit_name(number), inv)
        entries += service_lines(unit_name(number), inv, [f"unit {number} serving"])
    for number in crashing:
        entries += crashed_invocation(unit_name(number), seed_lines(), restarts=1)
    return entries


def many_units_config(root: Path, units: int) -> Config:
    base = demo_config(root)
    return dataclasses.replace(
        base,
        units=tuple(UnitConfig(name=unit_name(n)) for n in range(1, units + 1)),
        metrics=dataclasses.replace(base.metrics, enabled=False),
        journal=dataclasses.replace(base.journal, restart_backoff_s=0.1),
    )


@pytest.mark.parametrize(
    ("units", "crashing"), [(100, [1, 64, 65, 100]), (500, [1, 64, 65, 100, 499, 500])]
)
async def test_every_configured_units_crash_is_decided(
    tmp_path: Path, units: int, crashing: list[int]
) -> None:
    """With 100 and 500 units configured, the crashes of units 1, 64, 65, 100 (and 500) are
    each decided once, as a halt on the seed's fatal signature; the reader never restarts."""
    config = many_units_config(tmp_path, units)
    store = Store.in_directory(config.state.state_dir)
    daemon = compose_daemon(
        config, load_table(config), store=store, metrics=Metrics(new_registry(process=False))
    )
    stop = asyncio.Event()
    with JournalWriter(config.journal.directory) as writer:  # type: ignore[arg-type]
        writer.write(crash_journal(units, crashing))
        task = asyncio.create_task(daemon.run(stop))
        try:
            await poll(
                lambda: task.done() or len(store.history()) >= len(crashing),
                within=30,
                each=writer.nudge,
            )
        except AssertionError:
            decided = sorted(item["unit"] for item in store.history())
            pytest.fail(
                f"{len(decided)} of {len(crashing)} crashes decided ({decided}) after 30 s;"
                f" reader restarts: {daemon.reader.restarts}"
            )
        finally:
            stop.set()
            await asyncio.wait_for(task, 15)
    history = store.history()
    store.close()
    assert sorted(item["unit"] for item in history) == [unit_name(n) for n in crashing]
    assert {item["verdict"]["signature"] for item in history} == {"flashinfer_cubin_mismatch"}
    assert daemon.reader.restarts == 0
