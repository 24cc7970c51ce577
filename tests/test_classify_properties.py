"""Property-based tests: no log content can break the classifier, the determinism model or
the policy, and what they promise holds for any input.

Lines are drawn from fragments of every crash form the parser knows (Python tracebacks and
their chains, caret markers, Rust panics, argparse / click / clap usage errors, C++ terminate +
what(), faulthandler dumps, logging prefixes of vLLM, SGLang, TGI, Ray, Kubernetes and Python's
logging) mixed with arbitrary text, control characters and very long lines. Asserted: nothing
raises; a failed invocation always gets a root cause and a confidence; an inferred fatal is
never a crash after serving; the policy never halts on an inference after serving; phase
severities in a signature file are checked at load with an error naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_supervisor.classify.classifier import Classifier, best_guess
from vllm_supervisor.classify.determinism import Phase, assess, phase_of
from vllm_supervisor.classify.logline import annotate, crash_form, parse_line
from vllm_supervisor.classify.signatures import SignatureTable, load_signature_table
from vllm_supervisor.decide.policy import RestartPolicy
from vllm_supervisor.errors import SignatureTableError
from vllm_supervisor.model import Action, Ending, Evidence, Invocation, LogLine, Severity

PREFIXES = (
    "",
    "(EngineCore_DP0 pid=68) ERROR 02-06 16:34:06 [core.py:936] ",
    "(APIServer pid=1) INFO 11-30 10:01:03 [api_server.py:1839] ",
    "[2025-08-06 20:26:20 TP0] ",
    "2024-03-28T01:20:32.907Z ERROR text_generation_launcher: ",
    "(RayWorkerWrapper pid=2103, ip=10.0.0.5) ",
    "2025-03-08 02:04:48,697 - __main__ - INFO - ",
    "2025-06-09T17:46:28.123456789+08:00 stdout F ",
    "ERROR 07-18 10:29:03 [config.py:130] ",
)
FRAGMENTS = (
    "Traceback (most recent call last):",
    '  File "/opt/vllm/vllm/v1/engine/core.py", line 699, in run_engine_core',
    "    engine_core = EngineCoreProc(*args, **kwargs)",
    "                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    "The above exception was the direct cause of the following exception:",
    "During handling of the above exception, another exception occurred:",
    "RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version (0.6.4)",
    "KeyError: 'model.layers.0.mlp.experts.w13_weight'",
    "ValueError:",
    "StopIteration",
    "requests.exceptions.ConnectionError: HTTPSConnectionPool(host='huggingface.co', port=443)",
    "thread 'main' panicked at router/src/main.rs:101:70:",
    "called `Result::unwrap()` on an `Err` value: Tokenizer",
    "note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace",
    "api_server.py: error: argument --dtype: invalid choice: 'float13'",
    "error: invalid value 'True' for '--disable-custom-kernels'",
    "Error: No such option: --model-path",
    "terminate called after throwing an instance of 'c10::DistBackendError'",
    "  what():  [PG ID 2 PG GUID 3 Rank 1] Process group watchdog thread terminated",
    "Fatal Python error: Segmentation fault",
    'Thread 0x00007f (most recent call first):\n  File "x.py", line 3 in f',
    '  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap',
    "EngineCore failed to start.",
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s):",
    "INFO:     Application startup complete.",
    "Failed to import from vllm._C with ModuleNotFoundError(\"No module named 'vllm._C'\")",
    "[repeated 22x across cluster]",
    "",
    "\x1b[31m\x00\r",
)
LINE = st.one_of(
    st.tuples(st.sampled_from(PREFIXES), st.sampled_from(FRAGMENTS)).map("".join),
    st.text(max_size=200),
    st.sampled_from(FRAGMENTS).map(lambda f: f * 40),
)
LINES = st.lists(LINE, max_size=40)
ENDINGS = st.sampled_from(list(Ending))
PHASES = st.builds(
    Phase,
    served=st.booleans(),
    ran_s=st.one_of(st.none(), st.floats(0, 1e6)),
    serving_s=st.one_of(st.none(), st.floats(0, 1e6)),
)
DRIFT = st.lists(
    st.sampled_from(("flashinfer-python 0.6.3 → 0.6.4", "torch 2.5 → 2.6")), max_size=2
)


@pytest.fixture(scope="module", name="table")
def _table() -> SignatureTable:
    return load_signature_table()


def _invocation(
    texts: list[str], *, served: bool, status: int, ending: Ending = Ending.EXITED
) -> Invocation:
    lines = tuple(LogLine(text=t, realtime_us=1_000 + n) for n, t in enumerate(texts))
    return Invocation(
        unit="vllm.service",
        invocation_id="0" * 32,
        lines=lines,
        total_lines=len(lines),
        ending=ending,
        exit_code="exited",
        exit_status=status,
        result="exit-code" if status else "success",
        started_us=0,
        served_us=10 if served else None,
        ended_us=10_000_000,
    )


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class TestClassifierProperties:
    @SETTINGS
    @given(texts=LINES, served=st.booleans(), status=st.sampled_from((0, 1, 2, 137)))
    def test_a_failed_invocation_always_has_a_cause(
        self, table: SignatureTable, texts: list[str], served: bool, status: int
    ) -> None:
        """Any lines: no exception, and a failed start names a root cause and a confidence."""
        invocation = _invocation(texts, served=served, status=status)
        verdict = Classifier(table).classify_invocation(invocation)
        if invocation.failed:
            assert verdict.root_cause, verdict
            assert verdict.confidence in {"high", "medium", "low"}
            assert verdict.crashed

    @SETTINGS
    @given(texts=LINES, drift=DRIFT, phase=PHASES, status=st.sampled_from((0, 1)))
    def test_assess_and_decide_keep_their_promises(
        self,
        table: SignatureTable,
        texts: list[str],
        drift: list[str],
        phase: Phase,
        status: int,
    ) -> None:
        """No inferred fatal after serving; the policy halts an inference only before it; a
        verdict's basis is one of the three, and every inferred one says why."""
        invocation = _invocation(texts, served=phase.served, status=status)
        verdict = assess(
            Classifier(table).classify_invocation(invocation), invocation, phase, drift
        )
        assert verdict.basis in {None, "signature", "inferred", "unknown"}
        if verdict.basis == "inferred":  # a wrapper's signature may stay: it names no severity
            assert verdict.severity_reason
            assert not (phase.served and verdict.severity is Severity.FATAL)
        decision = RestartPolicy().decide(invocation, verdict, Evidence(phase=phase))
        if decision.rule == "inferred_fatal":
            assert decision.action is Action.HALT and not phase.served
        if not invocation.failed and not verdict.crashed:
            assert decision.action is Action.OBSERVE

    @SETTINGS
    @given(texts=LINES, ending=ENDINGS)
    def test_any_ending_is_decided(
        self, table: SignatureTable, texts: list[str], ending: Ending
    ) -> None:
        """Every way an invocation ends gets a decision; the not-a-crash ones never halt."""
        invocation = _invocation(texts, served=False, status=1, ending=ending)
        verdict = Classifier(table).classify_invocation(invocation)
        phase = phase_of(invocation, 600.0, verdict.phase_hint)
        decision = RestartPolicy().decide(
            invocation, assess(verdict, invocation, phase), Evidence(phase=phase)
        )
        if ending in (Ending.STOPPED, Ending.SKIPPED, Ending.GATE_STOPPED, Ending.BOOT):
            assert decision.action is Action.OBSERVE


class TestParserProperties:
    @SETTINGS
    @given(texts=LINES)
    def test_crash_forms_and_guesses_never_raise(self, texts: list[str]) -> None:
        """The line parser, the crash-form reader and the best guess take any lines; a guess is
        always text of one of the lines."""
        lines = [LogLine(text=t) for t in texts]
        ann = annotate(lines)
        for index in range(len(ann.lines)):
            form = crash_form(ann, index)
            assert form is None or isinstance(form, str)
        guess, last = best_guess(lines)
        stripped = {parse_line(line).text.strip() for line in lines}
        assert guess is None or guess in stripped
        assert last is None or last in stripped


class TestPhaseSeverityInTables:
    @given(value=st.one_of(st.text(max_size=12), st.integers(), st.booleans()))
    @settings(max_examples=60, deadline=None)
    def test_a_phase_severity_is_checked_at_load(
        self, tmp_path_factory: pytest.TempPathFactory, value: object
    ) -> None:
        """startup_severity takes fatal, transient or unknown; anything else is one error that
        names the file and the key (or, for a value TOML itself refuses, the file)."""
        path = Path(tmp_path_factory.mktemp("sigs")) / "x.toml"
        literal = json.dumps(value) if isinstance(value, str) else str(value).lower()
        path.write_text(
            '[[signature]]\nid = "x_one"\ntitle = "x"\nseverity = "fatal"\n'
            f"patterns = ['boom']\nstartup_severity = {literal}\n",
            encoding="utf-8",
        )
        if value in ("fatal", "transient", "unknown"):
            table = load_signature_table([path])
            assert table.get("x_one") is not None
            return
        with pytest.raises(SignatureTableError) as raised:
            load_signature_table([path])
        message = str(raised.value)
        assert "x.toml" in message
        assert "invalid TOML" in message or "startup_severity" in message, message
