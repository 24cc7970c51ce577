"""A request's error is never the cause of a crash, a hang or a stop (issue 34, 3).

Seen before: one request's ASGI `ValueError` (sampling parameters) then a crash with nothing
else was `vllm_config_invalid` with the request's error as root cause; one request's Jinja
`TemplateError` then a person's stop had the `TemplateError` as root cause. An operator reading
that goes after the wrong thing: a request's error ends that request, not the server. The
request's lines are vLLM's own (tests/data/requests: its uvicorn and serving_chat.py paths).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_supervisor.classify.table import load_table
from vllm_supervisor.config import Config, UnitConfig
from vllm_supervisor.journal.saved import decode_export
from vllm_supervisor.journal.writer import (
    FieldValue,
    exit_entries,
    export_entry,
    service_lines,
    start_entries,
    stop_job_entries,
)
from vllm_supervisor.model import Action, Outcome
from vllm_supervisor.pipeline import Pipeline

UNIT = "vllm.service"
DATA = Path(__file__).resolve().parent / "data" / "requests"
CONFIG = Config(units=(UnitConfig(name=UNIT),))
REQUEST_ERRORS = {
    "asgi-value-error.txt": "max_tokens must be at least 1",
    "template-error.txt": "Conversation roles must alternate",
}


def _lines(*names: str) -> list[str]:
    return [line for name in names for line in (DATA / name).read_text().splitlines()]


def _decided(lines: list[str], *, stopped: bool = False, status: int = 1) -> Outcome:
    inv = uuid.uuid4().hex
    entries: list[dict[str, FieldValue]] = [*start_entries(UNIT, inv)]
    entries += service_lines(UNIT, inv, lines)
    if stopped:
        entries += stop_job_entries(UNIT, inv)
    entries += exit_entries(UNIT, inv, status)
    pipeline = Pipeline(CONFIG, load_table(CONFIG))
    data = b"".join(export_entry(e) for e in entries)
    ended = pipeline.feed(list(decode_export(data))) + pipeline.finish()
    [outcome] = pipeline.decide_all(ended)
    return outcome


def _not_the_cause(outcome: Outcome, words: str) -> None:
    verdict = outcome.verdict
    assert words not in (verdict.root_cause or ""), verdict
    assert "serving_chat.py" not in (verdict.crash_site or ""), verdict.crash_site
    assert "sampling_params.py" not in (verdict.crash_site or ""), verdict.crash_site
    assert outcome.decision.action is not Action.HALT, outcome.decision


@pytest.mark.parametrize(("request_error", "words"), sorted(REQUEST_ERRORS.items()))
def test_a_request_error_then_a_crash_with_nothing_else(request_error: str, words: str) -> None:
    outcome = _decided(_lines("serving.txt", request_error))
    _not_the_cause(outcome, words)
    assert outcome.verdict.signature is None
    assert any("requests do not end the server" in n for n in outcome.verdict.notes), outcome


@pytest.mark.parametrize(("request_error", "words"), sorted(REQUEST_ERRORS.items()))
def test_a_persons_stop_after_a_request_error(request_error: str, words: str) -> None:
    outcome = _decided(_lines("serving.txt", request_error), stopped=True, status=0)
    _not_the_cause(outcome, words)
    assert outcome.decision.action is Action.OBSERVE


@pytest.mark.parametrize(("request_error", "words"), sorted(REQUEST_ERRORS.items()))
def test_a_worker_killed_long_after_a_request_error(request_error: str, words: str) -> None:
    busy = [f"INFO 12-05 10:0{n % 10}:00 [loggers.py:123] Engine 000: Running: 1 reqs"
            for n in range(5000)]  # fmt: skip
    lines = [*_lines("serving.txt", request_error), *busy, *_lines("worker-died.txt")]
    outcome = _decided(lines)
    _not_the_cause(outcome, words)
    assert "Worker proc VllmWorker-0 died unexpectedly" in (outcome.verdict.root_cause or "")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    order=st.permutations(["asgi-value-error.txt", "template-error.txt", "serving.txt"]),
    stopped=st.booleans(),
    status=st.sampled_from([0, 1, 137]),
)
def test_no_order_of_request_errors_makes_one_the_cause(
    order: list[str], stopped: bool, status: int
) -> None:
    outcome = _decided(_lines(*order), stopped=stopped, status=status)
    for words in REQUEST_ERRORS.values():
        _not_the_cause(outcome, words)


def _decided_at(pipeline: Pipeline, lines: list[str], *, started_s: float, ran_s: float) -> Outcome:
    """One run of `ran_s` seconds, its lines at its end (as a lazy import fails at a request)."""
    inv, start = uuid.uuid4().hex, int(started_s * 1e6)
    entries = [*start_entries(UNIT, inv), *service_lines(UNIT, inv, lines)]
    entries += exit_entries(UNIT, inv, 1)
    for n, entry in enumerate(entries):
        late = n >= 2
        entry["__REALTIME_TIMESTAMP"] = start + int(ran_s * 1e6) * late + n
    data = b"".join(export_entry(e) for e in entries)
    ended = pipeline.feed(list(decode_export(data))) + pipeline.finish()
    [outcome] = pipeline.decide_all(ended)
    return outcome


def test_a_lazy_import_in_a_request_handler_restarts_then_halts_right_after_serving() -> None:
    """No serving line (`--uvicorn-log-level warning`); the crash's traceback runs through
    the non-streaming chat handler: it served. After 5 minutes a restart gives service back;
    the same crash at the next start's first request (65 s in) halts."""
    pipeline = Pipeline(CONFIG, load_table(CONFIG))
    lines = _lines("lazy-import.txt")
    first = _decided_at(pipeline, lines, started_s=1.7e9, ran_s=300)
    assert first.verdict.phase_hint == "serving"
    assert "No module named 'librosa'" in (first.verdict.root_cause or "")
    assert first.decision.action is Action.ALLOW_RESTART, first.decision
    second = _decided_at(pipeline, lines, started_s=1.7e9 + 400, ran_s=65)
    assert second.decision.action is Action.HALT, second.decision
