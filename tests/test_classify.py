"""The classifier: root cause, severity, captures and crash site of an invocation's lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_supervisor.classify.classifier import Classifier
from vllm_supervisor.classify.signatures import SignatureTable, load_signature_table
from vllm_supervisor.model import LogLine, Severity

SEED = Path(__file__).resolve().parents[1] / "supervisor" / "data" / "seed-flashinfer-crash.log"


@pytest.fixture(scope="module", name="classifier")
def _classifier() -> Classifier:
    return Classifier(load_signature_table())


def _lines(text: str) -> list[LogLine]:
    return [LogLine(text=t) for t in text.strip("\n").splitlines()]


def _journal_lines(path: Path) -> list[LogLine]:
    """A saved `journalctl` text file as LogLines carrying the journal pid."""
    lines = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        m = re.search(r"\[(\d+)\]: ", raw)
        lines.append(LogLine(text=raw, pid=int(m.group(1)) if m else None))
    return lines


class TestSeed:
    def test_seed_root_cause_is_the_cubin_line(self, classifier: Classifier) -> None:
        """The seed's cause is flashinfer's version check, not the API server's wrapper."""
        verdict = classifier.classify(_journal_lines(SEED))
        assert verdict.signature == "flashinfer_cubin_mismatch"
        assert verdict.severity is Severity.FATAL
        assert verdict.root_cause is not None
        assert verdict.root_cause.startswith("RuntimeError: flashinfer-cubin version (0.6.3)")
        assert dict(verdict.captures) == {"cubin": "0.6.3", "flashinfer": "0.6.4"}
        assert verdict.crashed
        assert verdict.fingerprint is not None

    def test_seed_crash_site_is_the_model_layer(self, classifier: Classifier) -> None:
        """The crash site is the deepseek_v2.py frame that built the attention layer."""
        verdict = classifier.classify(_journal_lines(SEED))
        assert verdict.crash_site is not None
        assert 'deepseek_v2.py", line 998, in __init__' in verdict.crash_site
        assert "self.self_attn = attn_cls(" in verdict.crash_site

    def test_seed_remediation_names_both_versions(self, classifier: Classifier) -> None:
        """The remediation is rendered with both captured versions."""
        verdict = classifier.classify(_journal_lines(SEED))
        assert verdict.remediation is not None
        assert "0.6.3" in verdict.remediation
        assert "0.6.4" in verdict.remediation

    def test_seed_as_plain_text(self, classifier: Classifier) -> None:
        """The same file without journal pids classifies the same way."""
        plain = [LogLine(text=t) for t in SEED.read_text(encoding="utf-8").splitlines()]
        assert classifier.classify(plain).signature == "flashinfer_cubin_mismatch"


CHAINED = """
Traceback (most recent call last):
  File "/x/vllm/model_executor/models/registry.py", line 434, in _run_in_subprocess
    returned.check_returncode()
KeyError: 'weird_inner_cause'

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/x/vllm/model_executor/models/registry.py", line 270, in _try_inspect_model_cls
    raise RuntimeError("outer")
RuntimeError: Error raised in subprocess
"""

DURING_HANDLING = """
Traceback (most recent call last):
  File "/x/a.py", line 1, in f
    g()
ZeroDivisionError: division by zero

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/x/b.py", line 2, in h
    raise ValueError("cleanup failed")
ValueError: cleanup failed
"""

WRAPPER_AFTER_CAUSE = """
(EngineCore_DP0 pid=9) ERROR 01-01 00:00:00 [core.py:708] EngineCore failed to start.
(EngineCore_DP0 pid=9) ERROR 01-01 00:00:00 [core.py:708] Traceback (most recent call last):
(EngineCore_DP0 pid=9) ERROR 01-01 00:00:00 [core.py:708]   File "/x/vllm/worker/worker.py", line 372, in raise_if_cache_size_invalid
(EngineCore_DP0 pid=9) ERROR 01-01 00:00:00 [core.py:708]     raise ValueError(
(EngineCore_DP0 pid=9) ERROR 01-01 00:00:00 [core.py:708] ValueError: The model's max seq len (32768) is larger than the maximum number of tokens that can be stored in KV cache (8000). Try increasing `gpu_memory_utilization`.
(APIServer pid=1) RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""  # noqa: E501

WRAPPER_ONLY = """
(EngineCore_0 pid=271) ERROR 08-25 12:24:19 [multiproc_executor.py:146] Worker proc VllmWorker-1 died unexpectedly, shutting down executor.
(VllmWorker TP0 pid=405) INFO 08-25 12:24:19 [multiproc_executor.py:520] Parent process exited, terminating worker
"""  # noqa: E501

WRAPPER_BEFORE_CAUSE = """
CRITICAL 03-15 17:24:18 [multiproc_executor.py:48] MulitprocExecutor got fatal signal from worker processes, shutting down. See stack trace above for root cause issue.
(VllmWorker rank=0 pid=754) Traceback (most recent call last):
(VllmWorker rank=0 pid=754)   File "/x/vllm/platforms/cuda.py", line 123, in set_device
(VllmWorker rank=0 pid=754)     torch.cuda.set_device(device)
(VllmWorker rank=0 pid=754) RuntimeError: CUDA error: no kernel image is available for execution on the device
"""  # noqa: E501

NOISE_ONLY = """
(VllmWorkerProcess pid=570) WARNING 04-12 05:35:07 [fused_moe.py:659] Using default MoE config. Performance might be sub-optimal! Config file not found at /x.json
(Worker pid=1222) WARNING 02-28 08:53:10 [symm_mem.py:67] SymmMemCommunicator: Device capability 8.0 not supported, communicator is not available.
(Worker pid=1227) <frozen importlib._bootstrap_external>:1301: FutureWarning: The cuda.cudart module is deprecated and will be removed in a future release
(RayWorkerVllm pid=14289) Exception ignored in: <function NCCLCommunicator.__del__ at 0x7f4d8c3212d0>
(RayWorkerVllm pid=14289) Traceback (most recent call last):
(RayWorkerVllm pid=14289)   File "/x/pynccl.py", line 264, in __del__
(RayWorkerVllm pid=14289)     _c_ncclCommDestroy(self.comm)
(RayWorkerVllm pid=14289) AttributeError: 'NCCLCommunicator' object has no attribute 'comm'
"""  # noqa: E501

NOISE_THEN_CAUSE = """
WARNING 04-12 05:35:07 [fused_moe.py:659] Using default MoE config. Performance might be sub-optimal! Config file not found at /x.json
ERROR 04-12 05:35:08 [core.py:1] RuntimeError: CUDA error: no kernel image is available for execution on the device
ERROR 04-12 05:35:08 [core.py:1] CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.
"""  # noqa: E501

INTERLEAVED = """
(Worker_TP1 pid=12) ERROR 10-06 22:12:39 [multiproc_executor.py:597] Traceback (most recent call last):
(Worker_TP0 pid=11) ERROR 10-06 22:12:39 [multiproc_executor.py:597] Traceback (most recent call last):
(Worker_TP1 pid=12) ERROR 10-06 22:12:39 [multiproc_executor.py:597]   File "/x/vllm/model_executor/models/llama.py", line 20, in __init__
(Worker_TP0 pid=11) ERROR 10-06 22:12:39 [multiproc_executor.py:597]   File "/x/vllm/model_executor/models/qwen2.py", line 10, in __init__
(Worker_TP1 pid=12) ERROR 10-06 22:12:39 [multiproc_executor.py:597]     self.b = B()
(Worker_TP0 pid=11) ERROR 10-06 22:12:39 [multiproc_executor.py:597]     self.a = A()
(Worker_TP0 pid=11) ERROR 10-06 22:12:39 [multiproc_executor.py:597] SomeWeirdError: worker zero broke first
(Worker_TP1 pid=12) ERROR 10-06 22:12:39 [multiproc_executor.py:597] SomeWeirdError: worker one broke second
"""  # noqa: E501

UNKNOWN = """
Traceback (most recent call last):
  File "/x/vllm/entrypoints/openai/api_server.py", line 10, in main
    run()
FrobnicationError: the frobnicator 0x7f00 on host node-12 failed after 37 tries
"""

SPECIFIC_BEATS_GENERIC = """
[rank1]:[E ProcessGroupNCCL.cpp:475] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600001 milliseconds before timing out.
(Worker_TP0 pid=11) ERROR 10-06 22:12:39 [multiproc_executor.py:597] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.
"""  # noqa: E501

BARE_ASSERT = """
Traceback (most recent call last):
  File "/x/vllm/model_executor/layers/linear.py", line 1111, in weight_loader
    assert param_data.shape == loaded_weight.shape
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
AssertionError
"""

# Each case: log text, expected signature, severity, text the root cause must contain.
CASES = [
    # The cause of a chained traceback is the first one printed, not the outer error.
    pytest.param(CHAINED, None, Severity.UNKNOWN, "KeyError: 'weird_inner_cause'", id="chained"),
    # Same for 'During handling of the above exception'.
    pytest.param(DURING_HANDLING, None, Severity.UNKNOWN, "ZeroDivisionError", id="during"),
    # A generic wrapper printed after the real cause never wins.
    pytest.param(
        WRAPPER_AFTER_CAUSE,
        "kv_cache_insufficient",
        Severity.FATAL,
        "max seq len (32768)",
        id="wrapper-after-cause",
    ),
    # A wrapper with nothing else is the root cause, with the wrapper's severity.
    pytest.param(
        WRAPPER_ONLY, "worker_died", Severity.TRANSIENT, "VllmWorker-1 died", id="wrapper-only"
    ),
    # A wrapper printed before the real cause does not stop the search.
    pytest.param(
        WRAPPER_BEFORE_CAUSE,
        "cuda_no_kernel_image",
        Severity.FATAL,
        "no kernel image",
        id="wrapper-before-cause",
    ),
    # Noise before a cause is skipped.
    pytest.param(
        NOISE_THEN_CAUSE, "cuda_no_kernel_image", Severity.FATAL, "no kernel image", id="noise"
    ),
    # Interleaved workers: the earliest exception, with its own process's frames.
    pytest.param(INTERLEAVED, None, Severity.UNKNOWN, "worker zero broke first", id="interleaved"),
    # A specific cause outranks a generic consequence printed earlier (NCCL timeout).
    pytest.param(
        SPECIFIC_BEATS_GENERIC,
        "cuda_oom_runtime",
        Severity.TRANSIENT,
        "CUDA out of memory",
        id="priority",
    ),
    # A message-less exception reports its failing source line.
    pytest.param(
        BARE_ASSERT,
        "weight_shape_mismatch",
        Severity.FATAL,
        "assert param_data.shape == loaded_weight.shape",
        id="bare-assert",
    ),
]


class TestRootCause:
    @pytest.mark.parametrize(("text", "signature", "severity", "root"), CASES)
    def test_root_cause(
        self,
        classifier: Classifier,
        text: str,
        signature: str | None,
        severity: Severity,
        root: str,
    ) -> None:
        """The verdict names the expected root cause, signature and severity."""
        verdict = classifier.classify(_lines(text))
        assert verdict.root_cause is not None
        assert root in verdict.root_cause
        assert verdict.signature == signature
        assert verdict.severity is severity
        assert verdict.crashed

    def test_noise_is_never_root_cause(self, classifier: Classifier) -> None:
        """Benign warnings and a destructor's traceback give no root cause at all."""
        verdict = classifier.classify(_lines(NOISE_ONLY))
        assert verdict.root_cause is None
        assert verdict.severity is Severity.UNKNOWN
        assert verdict.fingerprint is None

    def test_interleaved_crash_site_follows_the_process(self, classifier: Classifier) -> None:
        """The crash site comes from the root cause's own worker, not the other one."""
        verdict = classifier.classify(_lines(INTERLEAVED))
        assert verdict.crash_site is not None
        assert "qwen2.py" in verdict.crash_site
        assert "self.a = A()" in verdict.crash_site
        assert "2 processes printed a traceback" in verdict.notes

    def test_unknown_crash_gets_a_fingerprint(self, classifier: Classifier) -> None:
        """An unrecognised exception is still the root cause, with a fingerprint."""
        verdict = classifier.classify(_lines(UNKNOWN))
        assert verdict.title == "Unrecognised crash"
        assert verdict.signature is None
        assert verdict.fingerprint is not None
        assert verdict.crash_site is not None
        assert "api_server.py" in verdict.crash_site

    def test_clean_log_is_not_a_crash(self, classifier: Classifier) -> None:
        """INFO lines alone are no crash."""
        verdict = classifier.classify(
            _lines("INFO 01-11 15:51:02 llm_engine.py:70] Initializing an LLM engine\n")
        )
        assert not verdict.crashed
        assert verdict.root_cause is None

    def test_cut_traceback_is_a_crash_without_cause(self, classifier: Classifier) -> None:
        """A traceback cut before its exception line is a crash with no root cause."""
        verdict = classifier.classify(
            _lines('Traceback (most recent call last):\n  File "/x/a.py", line 1, in f\n    g()\n')
        )
        assert verdict.crashed
        assert verdict.root_cause is None

    def test_empty_input(self, classifier: Classifier) -> None:
        """No lines, no crash."""
        assert not classifier.classify([]).crashed

    def test_subset_table_changes_the_verdict(self) -> None:
        """A per-unit table without the cuda domain cannot name a CUDA signature."""
        table: SignatureTable = load_signature_table().subset(["vllm", "noise"])
        verdict = Classifier(table).classify(_lines(NOISE_THEN_CAUSE))
        assert verdict.signature is None
        assert verdict.root_cause is not None


REDRESSED = """\
Traceback (most recent call last):
  File "/v/httpcore/_exceptions.py", line 14, in map_exceptions
    yield
httpcore.ReadError: [Errno 104] Connection reset by peer

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/v/httpx/_transports/default.py", line 118, in map_httpcore_exceptions
    raise mapped_exc(message) from exc
httpx.ReadError: [Errno 104] Connection reset by peer

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/v/transformers/configuration_utils.py", line 721, in _get_config_dict
    raise OSError(
OSError: Can't load the configuration of 'org/model'.
"""


class TestReraisedInTheSameWords:
    def test_the_callers_class_names_the_same_cause(self, classifier: Classifier) -> None:
        """httpx re-raises httpcore's error with its words: the verdict names httpx's line,
        the class its callers know, and not the later consequence in other words."""
        verdict = classifier.classify(_lines(REDRESSED))
        assert verdict.root_cause == "httpx.ReadError: [Errno 104] Connection reset by peer"

    def test_other_words_keep_the_first_exception(self, classifier: Classifier) -> None:
        """A re-raise in other words is a consequence: the first exception stays the cause."""
        text = REDRESSED.replace(
            "httpx.ReadError: [Errno 104] Connection reset by peer",
            "httpx.ReadError: the server closed the connection",
        )
        verdict = classifier.classify(_lines(text))
        assert verdict.root_cause == "httpcore.ReadError: [Errno 104] Connection reset by peer"


class TestLongInvocations:
    """Long invocations. Speed is measured by `python -m bench`, not asserted here: timed
    unit tests fail on loaded, shared machines without telling anything about the code."""

    def test_five_thousand_lines_still_find_the_cause(self, classifier: Classifier) -> None:
        """The seed's cause is found after 5,000 lines of engine statistics."""
        seed = _journal_lines(SEED)
        info = [
            LogLine(
                text=f"(APIServer pid=1) INFO 08-25 12:24:{i % 60:02d} [loggers.py:123] "
                f"Engine 000: Avg prompt throughput: {i}.0 tokens/s, Running: 46 reqs",
                pid=1,
            )
            for i in range(5000 - len(seed))
        ]
        verdict = classifier.classify(info + seed)
        assert verdict.signature == "flashinfer_cubin_mismatch"
