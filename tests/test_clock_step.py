"""A wall clock that steps in the middle of a start does not make a crash at load "served".

Was: the clock stepped forward an hour while a unit loaded (a person's `date -s`, NTP's first
sync on a host without an RTC), and the fatal crash that followed ran "3600 s" by the wall
clock, past `drift.good_start_s`: taken as "fatal after serving" and restarted, one model load
wasted. Durations are now measured on the monotonic clock the journal keeps beside the wall
clock (in each entry's cursor), as journald writes it; a real journal file here.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.triage import collect
from vllm_supervisor.config import Config
from vllm_supervisor.journal.cursor import cursor_monotonic, monotonic_seconds_between
from vllm_supervisor.journal.writer import (
    EntryFactory,
    JournalWriter,
    exit_entries,
    service_lines,
    start_entries,
)
from vllm_supervisor.model import Action

UNIT = "vllm.service"
CAUSE = (
    "RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version (0.6.4). "
    "Please install the same version of both packages."
)
HOUR_US = 3600 * 1_000_000


def crash_across_a_clock_step(directory: Path, step_us: int) -> None:
    """A start that loads for 2 s (monotonic), with the wall clock stepping by `step_us`."""
    factory = EntryFactory(clock_us=1_700_000_000_000_000)
    inv = uuid.uuid4().hex
    with JournalWriter(directory, factory=factory) as writer:
        writer.write(start_entries(UNIT, inv))
        writer.write(service_lines(UNIT, inv, ["INFO Loading model weights..."]))
        after_step = factory.clock_us + step_us
        stepped = [
            {
                **entry,
                "__REALTIME_TIMESTAMP": after_step,
                "__MONOTONIC_TIMESTAMP": factory.monotonic_us + 2_000_000,
            }
            for entry in service_lines(UNIT, inv, [CAUSE])
        ]
        writer.write(stepped)
        writer.write(exit_entries(UNIT, inv, 1))


def test_a_crash_at_load_across_a_clock_step_halts(tmp_path: Path) -> None:
    crash_across_a_clock_step(tmp_path / "journal", step_us=HOUR_US)
    config = Config()
    (outcome,) = collect(str(tmp_path / "journal"), config=config, table=load_table(config))
    assert outcome.verdict.signature == "flashinfer_cubin_mismatch"
    assert outcome.decision.action is Action.HALT, outcome.decision.reason
    assert outcome.invocation.ran_s is not None and outcome.invocation.ran_s < 10


@given(
    boot=st.text(alphabet="0123456789abcdef", min_size=1, max_size=32),
    first=st.integers(min_value=0, max_value=2**63),
    last=st.integers(min_value=0, max_value=2**63),
)
def test_seconds_between_cursors_of_one_boot(boot: str, first: int, last: int) -> None:
    a = f"s=x;i=1;b={boot};m={first:x};t=0;x=0"
    b = f"s=x;i=2;b={boot};m={last:x};t=0;x=0"
    assert monotonic_seconds_between(a, b) == max(0.0, (last - first) / 1e6)
    other = f"s=x;i=2;b=other{boot};m={last:x};t=0;x=0"
    assert monotonic_seconds_between(a, other) is None


@given(st.text())
def test_any_cursor_text_is_read_or_refused_never_raises(text: str) -> None:
    parsed = cursor_monotonic(text)
    assert parsed is None or (parsed[0] and parsed[1] >= 0)
