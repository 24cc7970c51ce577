"""A budget below zero names the cause, whatever the level of its line (issue 34, 2).

Seen blind (each log scored without the signatures written from it): vLLM's INFO `Available
KV cache memory: -2.77 GiB` before a cut traceback, and SGLang's unlevelled `max_total_tokens=
131072 is larger than the profiled value -561981. Use the profiled value instead.` before a bare
exit, were "no error line names the cause (a guess)": restarted twice. An allocator's budget
computed below zero is the fixed costs of the start exceeding the device: the lexicon's
`budget_below_zero` reads it deterministic and decisive, and such a line before the server
took requests is a cause candidate, its "instead" no coping.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.classify.classifier import Classifier
from vllm_supervisor.classify.determinism import judge
from vllm_supervisor.classify.signatures import DEFAULT_SIGNATURE_DIR, load_signature_table
from vllm_supervisor.journal import plain_text_invocation
from vllm_supervisor.model import Severity

# The table without the signatures that know these lines: the crash is new to it.
BLIND = Classifier(load_signature_table(
    [p for p in sorted(DEFAULT_SIGNATURE_DIR.glob("*.toml")) if p.name not in ("vllm.toml",
                                                                               "sglang.toml")]
))  # fmt: skip
KV = ("(EngineCore_DP0 pid=563) INFO 12-23 23:34:23 [gpu_worker.py:298] Available KV cache "
      "memory: -2.77 GiB")  # fmt: skip
FAILED = "(EngineCore_DP0 pid=563) ERROR 12-23 23:34:23 [core.py:708] EngineCore failed to start."
POOL = ("[2025-07-02 07:41:59 DP0 TP0] max_total_tokens=131072 is larger than the profiled value "
        "-561981. Use the profiled value instead.")  # fmt: skip
SERVING = "INFO:     Uvicorn running on http://0.0.0.0:8000 (Press CTRL+C to quit)"


@pytest.mark.parametrize(
    ("lines", "cause"),
    [([KV, FAILED], "Available KV cache memory"), ([POOL, POOL], "profiled value -561981")],
)
def test_a_budget_below_zero_before_serving_is_the_cause_and_fatal(
    lines: list[str], cause: str
) -> None:
    verdict, phase = judge(BLIND, plain_text_invocation(lines), good_start_s=1800.0)
    assert cause in (verdict.root_cause or ""), verdict
    assert verdict.severity is Severity.FATAL, verdict.severity_reason
    assert not phase.served


def test_once_the_server_took_requests_it_is_no_cause() -> None:
    """A client may have written any words after the serving line."""
    verdict, _ = judge(BLIND, plain_text_invocation([SERVING, KV]), good_start_s=1800.0)
    assert "Available KV cache memory" not in (verdict.root_cause or "")


@given(st.floats(min_value=0, max_value=1e6, allow_nan=False), st.sampled_from(["GiB", "MiB", ""]))
def test_a_budget_at_or_above_zero_is_no_cause(amount: float, unit: str) -> None:
    line = f"INFO 12-23 23:34:23 [gpu_worker.py:298] Available KV cache memory: {amount:.2f} {unit}"
    verdict, _ = judge(BLIND, plain_text_invocation([line]), good_start_s=1800.0)
    assert verdict.root_cause is None or "Available KV cache memory" not in verdict.root_cause
