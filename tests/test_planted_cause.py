"""No text outside the engine's own output can become a crash's cause (issue 37's planted cause).

Seen under systemd 252: a local user held the unit's port with a command line ending in a fatal
crash's text; the gate's line naming the holder (it runs in the unit's next start, so its lines
are that run's) became that run's first line, and when the run later died of a transient NCCL
timeout the daemon took the quoted text as the root cause: fatal, halted. The gate's lines (each
begins with the unit's name, or is one of its two fixed hints) are the supervisor's, never the
server's output: they are not kept as the run's lines.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st

from vllm_supervisor.classify.table import load_table
from vllm_supervisor.config import Config, UnitConfig
from vllm_supervisor.journal.export import decode_all
from vllm_supervisor.journal.writer import crashed_invocation
from vllm_supervisor.model import Action, Outcome
from vllm_supervisor.pipeline import Now, Pipeline
from vllm_supervisor.util.text import visible

UNIT = "vllm.service"
NCCL = (Path(__file__).parent / "e2e" / "data" / "nccl-timeout.log").read_text().splitlines()
PLANTED = "RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version (0.6.4)"
CONFIG = Config(units=(UnitConfig(name=UNIT),))


def _decided(first_lines: list[str]) -> Outcome:
    """One run whose first lines are `first_lines` (the gate's), then the NCCL timeout."""
    pipeline = Pipeline(CONFIG, load_table(CONFIG))
    raw = [
        {b"__CURSOR": b"c%d" % i, b"__REALTIME_TIMESTAMP": b"%d" % (i + 1_000_000)}
        | {k.encode(): str(v).encode("utf-8", "surrogateescape") for k, v in fields.items()}
        for i, fields in enumerate(crashed_invocation(UNIT, [*first_lines, *NCCL]))
    ]
    ended = pipeline.feed(decode_all(raw)) + pipeline.due(Now(journal_us=1 << 62))
    (outcome,) = pipeline.decide_all(ended)
    return outcome


def test_a_holders_command_line_quoted_by_the_gate_is_no_cause() -> None:
    gate_says = [
        f"{UNIT}: start allowed: the halt is lifted, port 8000 is free now (was: "
        f"signature=port_in_use; reason=fatal: port 8000 is held by PID 77 (python3 -c '# "
        f"{PLANTED}') of no unit (user mallory, uid 1001))",
        f"{UNIT}: port 8000 is still held by PID 77 (python3 -c '# {PLANTED}')",
        f"release it with: vllm-supervisor release {UNIT}",
    ]
    outcome = _decided(gate_says)
    assert outcome.verdict.signature == "nccl_timeout", outcome.verdict
    assert "flashinfer" not in (outcome.verdict.root_cause or "")
    assert outcome.decision.action is not Action.HALT


@given(quoted=st.text(max_size=300))
@example(quoted="\r")  # CI drew it: unescaped, a carriage return split the line in two
@settings(max_examples=50, deadline=None)
def test_no_text_the_gate_quotes_is_ever_the_root_cause(quoted: str) -> None:
    """Any text, as the gate writes it: its control characters escaped (a `\r` or a newline
    would begin a line of its own in the journal: supervisor.commands.gate._say)."""
    said = visible(f"{UNIT}: port 8000 is still held by PID 7 ({quoted} {PLANTED})")
    outcome = _decided([said])
    assert outcome.verdict.signature == "nccl_timeout"
    assert PLANTED not in (outcome.verdict.root_cause or "")
