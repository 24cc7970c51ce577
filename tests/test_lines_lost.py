"""A crash whose lines journald's rate limit may have dropped says so (issue 37, 4).

Seen under systemd 252: a flood of 300k lines then the seed crash. journald says "Suppressed N
messages" only when the unit logs again after its interval, after the decision: the first
verdict was "Failed without an error line", silent about the loss, and the loop went on. A run
that logged the unit's burst within one interval has had its later lines dropped (unless free
disk scaled the burst up): its verdict's notes and its decision's reason say so.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.classify.table import load_table
from vllm_supervisor.commands.triage import collect
from vllm_supervisor.config import Config, TrackerConfig, UnitConfig
from vllm_supervisor.journal.writer import crashed_invocation, export_entry
from vllm_supervisor.model import Invocation

UNIT = "vllm.service"
FLOOD = "WARNING request {} rejected: queue full"
SEED = "RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version (0.6.4)"


def _triaged(tmp_path: Path, lines: list[str], burst: int) -> tuple[dict, dict]:  # type: ignore[type-arg]
    log = tmp_path / "run.export"
    log.write_bytes(b"".join(export_entry(e) for e in crashed_invocation(UNIT, lines)))
    config = Config(units=(UnitConfig(name=UNIT),), tracker=TrackerConfig(ratelimit_burst=burst))
    [outcome] = collect(str(log), config=config, table=load_table(config))
    told = outcome.to_json()
    return told["verdict"], told["decision"]


def test_a_flood_past_the_burst_with_no_error_line_says_its_lines_may_be_lost(
    tmp_path: Path,
) -> None:
    verdict, decision = _triaged(tmp_path, [FLOOD.format(n) for n in range(60)], burst=50)
    [note] = [n for n in verdict["notes"] if "may have been dropped by journald" in n]
    assert "60 lines within one rate-limit interval" in note and "burst (50" in note
    assert decision["action"] == "allow-restart"  # never a halt on what was not seen
    assert note in decision["reason"]


def test_under_the_burst_nothing_is_said(tmp_path: Path) -> None:
    verdict, decision = _triaged(tmp_path, [FLOOD.format(n) for n in range(40)], burst=50)
    assert not any("journald" in n for n in verdict["notes"])
    assert "journald" not in decision["reason"]


def test_a_crash_whose_cause_came_through_is_not_doubted(tmp_path: Path) -> None:
    """The flood spent the burst, but the crash's line is there: a known verdict stands."""
    lines = [*(FLOOD.format(n) for n in range(60)), SEED]
    verdict, decision = _triaged(tmp_path, lines, burst=50)
    assert verdict["signature"] == "flashinfer_cubin_mismatch"
    assert "journald" not in decision["reason"]


@given(
    lines=st.integers(0, 10**7),
    burst=st.integers(0, 10**7),
    suppressed=st.integers(0, 10**7),
    total=st.integers(0, 10**7),
)
def test_what_is_said_follows_the_counts(
    lines: int, burst: int, suppressed: int, total: int
) -> None:
    """No counts raise; a loss is said exactly when journald said it, nothing reached the
    journal, or the run logged the burst within one interval."""
    inv = Invocation(
        unit=UNIT,
        invocation_id="i",
        lines=(),
        total_lines=total,
        suppressed_lines=suppressed,
        lines_in_limit_interval=lines,
        limit_burst=burst,
    )
    said = inv.lines_lost()
    expected = bool(suppressed) or total == 0 or (burst > 0 and lines >= burst)
    assert (said is not None) == expected
    assert (
        dataclasses.replace(inv, limit_burst=0, total_lines=1, suppressed_lines=0).lines_lost()
        is None
    )
