"""The determinism model reads a crash no signature knows as an engineer would: its words, its
class, where it was raised, the raise statement of a cut traceback, what wraps it, how the
run ended; each verdict names the evidence it used. Cases are the kinds issue 23 lists (real
crash logs collected after the corpus), written here as short lines of their own."""

from __future__ import annotations

import dataclasses

import pytest
from corpus_judge import GOOD_START_S, failed_invocation
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_supervisor.classify.classifier import Classifier
from vllm_supervisor.classify.determinism import judge
from vllm_supervisor.classify.signatures import SignatureTable, load_signature_table
from vllm_supervisor.decide.policy import RestartPolicy
from vllm_supervisor.model import Action, Evidence, Invocation, Severity, Verdict

V1 = "(EngineCore_DP0 pid=563) ERROR 12-23 23:34:23 [core.py:708] "
SITE = "/opt/venv/lib/python3.12/site-packages"
SERVING = "INFO:     Application startup complete."


@pytest.fixture(scope="module", name="empty")
def _empty() -> SignatureTable:
    """No signature at all: everything below is the model's own reading."""
    return SignatureTable([])


@pytest.fixture(scope="module", name="table")
def _table() -> SignatureTable:
    """The shipped table less its signature for a missing kernel image, so that only its
    catch-all for any CUDA error knows that line."""
    shipped = load_signature_table()
    return SignatureTable([s for s in shipped.signatures if s.id != "cuda_no_kernel_image"])


def _judge(table: SignatureTable, texts: list[str], **changes: object) -> Verdict:
    invocation = dataclasses.replace(failed_invocation(texts), **changes)  # type: ignore[arg-type]
    verdict, _ = judge(Classifier(table), invocation, GOOD_START_S)
    return verdict


def _traceback(*frames: tuple[str, str], exception: str | None) -> list[str]:
    lines = [f"{V1}Traceback (most recent call last):"]
    for frame, code in frames:
        lines += [f"{V1}  {frame}", f"{V1}    {code}"]
    return [*lines, f"{V1}{exception}"] if exception else lines


def _frame(path: str, line: int, function: str, code: str) -> tuple[str, str]:
    """A traceback frame and its source line, for `_traceback`."""
    return f'File "{path}", line {line}, in {function}', code


LOADER = (f'File "{SITE}/vllm/model_executor/model_loader/loader.py", line 9, in load_model', "x")


class TestWordsOfAnyClass:
    @pytest.mark.parametrize(
        "exception",
        [
            # An optional kernel backend not available.
            "RuntimeError: The FlashInfer sampling kernels are not available on this platform",
            # Quantized weights that cannot be loaded for the model.
            "RuntimeError: Cannot load AWQ weights into Gemma3ForCausalLM: unsupported layout",
            # A workspace budget exceeded while loading.
            "RuntimeError: Requested workspace (2.1 GiB) exceeds the accelerator's budget",
            # Plain memory short while loading.
            "torch.AcceleratorError: CUDA error: out of memory",
            # A name that is none of the things it may be (SGLang 0.5.23's chat template,
            # recorded here: corpus 520).
            "RuntimeError: Chat template /x/t.jinja is not a built-in template name or a valid "
            "chat template file path.",
        ],
    )
    def test_a_runtime_error_worded_deterministic_is_fatal(
        self, empty: SignatureTable, exception: str
    ) -> None:
        """A RuntimeError says nothing by its class; its words say a restart cannot change it."""
        verdict = _judge(empty, _traceback(LOADER, exception=exception))
        assert (verdict.severity, verdict.basis) == (Severity.FATAL, "inferred")
        assert verdict.severity_reason is not None
        assert "before the server ever served" in verdict.severity_reason
        assert "evidence: words " in verdict.severity_reason

    @pytest.mark.parametrize(
        "line",
        [
            # A placement that gives the driver no GPU.
            "ERROR 05-02 10:01:02 [ray_utils.py:77] Current node has no GPU available. "
            "current_node_resource={'CPU': 8.0}, node_ip=10.0.0.3",
            # An architecture with no implementation.
            "ERROR 05-02 10:01:02 [registry.py:310] Model architecture FooForCausalLM has no "
            "vLLM implementation",
            # An environment variable that does not parse as a number.
            "ERROR 05-02 10:01:02 [envs.py:40] VLLM_PORT='80a' is not a valid integer",
        ],
    )
    def test_an_error_line_with_no_class(self, empty: SignatureTable, line: str) -> None:
        """An error-level line with no exception class is read by its words."""
        verdict = _judge(empty, [line])
        assert verdict.root_cause == line.split("] ", 1)[1]
        assert (verdict.severity, verdict.basis) == (Severity.FATAL, "inferred")

    def test_a_hub_429_is_transient(self, empty: SignatureTable) -> None:
        """HTTP 429 from the model hub: the textbook transient, never halted."""
        verdict = _judge(
            empty,
            _traceback(
                (f'File "{SITE}/huggingface_hub/utils/_http.py", line 477, in hf_raise', "x"),
                exception="huggingface_hub.errors.HfHubHTTPError: 429 Client Error: Too Many "
                "Requests for url: https://huggingface.co/api/models/org/model",
            ),
        )
        assert (verdict.severity, verdict.basis) == (Severity.TRANSIENT, "inferred")
        decisions = [
            RestartPolicy().decide(failed_invocation(["x"]), verdict).action for _ in range(5)
        ]
        assert Action.HALT not in decisions

    def test_words_both_ways_stay_unknown(self, empty: SignatureTable) -> None:
        """A missing file or the network: equally strong both ways, neither is inferred."""
        verdict = _judge(
            empty,
            [f"{V1}OSError: cannot find config.json in the cache; check your internet connection"],
        )
        assert (verdict.severity, verdict.basis) == (Severity.UNKNOWN, "unknown")
        assert verdict.severity_reason is not None
        assert "both as deterministic and as a network" in verdict.severity_reason

    def test_a_memory_checks_numbers_decide(self, empty: SignatureTable) -> None:
        """More wanted than the GPU has at all is fatal; more than is free (a leftover process
        holds the rest) is transient: the message's advice is the same in both."""
        tail = "Decrease GPU memory utilization or reduce GPU memory used by other processes."
        leftover = "ValueError: Free memory on device cuda:0 (1.5/22.0 GiB) on startup is less "
        impossible = "ValueError: Free memory on device cuda:0 (21.5/22.0 GiB) on startup is less "
        cases = {
            leftover + f"than desired GPU memory utilization (0.9, 19.8 GiB). {tail}": (
                Severity.TRANSIENT
            ),
            impossible + f"than desired GPU memory utilization (1.0, 40.0 GiB). {tail}": (
                Severity.FATAL
            ),
        }
        for line, severity in cases.items():
            verdict = _judge(empty, [f"{V1}{line}"])
            assert severity is verdict.severity, verdict.severity_reason
            assert verdict.severity_reason is not None and "numbers " in verdict.severity_reason


class TestWhatWrapsTheCause:
    def test_an_ansi_ray_prefix_before_a_value_error(self, empty: SignatureTable) -> None:
        """A Ray actor's tag in colour, after the logger's prefix: the ValueError is the cause."""
        line = (
            "ERROR 06-28 06:11:45 worker_base.py:145] \x1b[36m(RayWorkerWrapper pid=2103, "
            "ip=10.0.0.5)\x1b[0m ValueError: Bfloat16 is only supported on GPUs with compute "
            "capability of at least 8.0."
        )
        verdict = _judge(empty, [line])
        assert verdict.root_cause is not None
        assert verdict.root_cause.startswith("ValueError: Bfloat16 is only supported")
        assert verdict.severity is Severity.FATAL

    def test_a_worker_wrapper_carries_the_message(self, empty: SignatureTable) -> None:
        """`Exception in worker ... while processing method init_device: <cause>` with the
        traceback cut: the carried cause's words decide."""
        verdict = _judge(
            empty,
            [
                "(VllmWorkerProcess pid=500) ERROR 04-12 05:35:29 [multiproc_worker_utils.py:"
                "238] Exception in worker VllmWorkerProcess while processing method init_device:"
                " CUDA error: invalid device ordinal, Traceback (most recent call last):",
                "(VllmWorkerProcess pid=500) ERROR 04-12 05:35:29 [multiproc_worker_utils.py:"
                f'238]   File "{SITE}/vllm/worker/worker.py", line 166, in init_device',
            ],
        )
        assert verdict.root_cause is not None and "invalid device ordinal" in verdict.root_cause
        assert verdict.severity is Severity.FATAL

    def test_the_raise_statement_of_a_cut_traceback(self, empty: SignatureTable) -> None:
        """Cut before its exception line, the innermost frame still shows what it raised."""
        verdict = _judge(
            empty,
            _traceback(
                LOADER,
                _frame(
                    f"{SITE}/vllm/model_executor/layers/quantization/awq.py",
                    88,
                    "get_quant_method",
                    'raise ValueError(f"Unsupported quantization layout {layout} for {arch}")',
                ),
                exception=None,
            ),
        )
        assert verdict.root_cause == (
            'raise ValueError(f"Unsupported quantization layout {layout} for {arch}")'
        )
        assert (verdict.severity, verdict.basis) == (Severity.FATAL, "inferred")

    def test_a_standard_library_helper_raises_for_its_caller(self, empty: SignatureTable) -> None:
        """vLLM's model registry runs the model's inspection in a subprocess; it fails and
        `subprocess.check_returncode` raises CalledProcessError. The helper only reports its
        caller's result: the raise site is the registry (model loading), and a start-up crash
        raised there is fatal."""
        verdict = _judge(
            empty,
            _traceback(
                LOADER,
                _frame(
                    f"{SITE}/vllm/model_executor/models/registry.py",
                    434,
                    "_run_in_subprocess",
                    "returned.check_returncode()",
                ),
                _frame(
                    "/usr/lib/python3.12/subprocess.py",
                    502,
                    "check_returncode",
                    "raise CalledProcessError(self.returncode, self.args, self.stdout,",
                ),
                exception="subprocess.CalledProcessError: Command '['/venv/bin/python', "
                "'-m', 'vllm.model_executor.models.registry']' returned non-zero exit status 1.",
            ),
        )
        assert (verdict.severity, verdict.basis) == (Severity.FATAL, "inferred")
        assert verdict.severity_reason is not None
        assert "raised in 'vllm/model_executor/models/registry.py'" in verdict.severity_reason

    def test_a_standard_library_site_of_its_own_counts(self, empty: SignatureTable) -> None:
        """socket.py is a network site itself: its caller is not asked."""
        verdict = _judge(
            empty,
            _traceback(
                LOADER,
                _frame(
                    f"{SITE}/vllm/model_executor/model_loader/weight_utils.py",
                    9,
                    "fetch",
                    "sock.connect(addr)",
                ),
                _frame("/usr/lib/python3.12/socket.py", 850, "create_connection", "raise err"),
                exception="OSError: [Errno 113] No route to host",
            ),
        )
        assert verdict.severity is not Severity.FATAL

    @pytest.mark.parametrize("statement", ["raise Exception(", "raise RuntimeError()"])
    def test_a_raise_statement_without_its_message_names_no_cause(
        self, empty: SignatureTable, statement: str
    ) -> None:
        """SGLang's `raise Exception(` with its message on the lines the traceback does not
        show: the statement is still the best line, but a class raised for anything, with no
        words, names no cause (low confidence: repeats of it never halt on their own)."""
        verdict = _judge(
            empty,
            _traceback(
                LOADER,
                _frame(
                    f"{SITE}/sglang/srt/model_executor/cuda_graph_runner.py",
                    239,
                    "__init__",
                    statement,
                ),
                exception=None,
            ),
        )
        assert verdict.root_cause == statement
        assert verdict.severity is Severity.UNKNOWN
        assert verdict.confidence == "low"

    def test_a_message_that_only_introduces_is_a_wrapper(self, empty: SignatureTable) -> None:
        """`EngineCore failed to start.` then a cut traceback: nothing is inferred from it."""
        verdict = _judge(empty, [f"{V1}EngineCore failed to start.", *_traceback(exception=None)])
        assert verdict.severity is Severity.UNKNOWN
        assert verdict.confidence == "low"

    def test_a_wrapper_ranks_below_a_quieter_cause(self, empty: SignatureTable) -> None:
        """A warning carrying the import's exception explains more than the wrapper after it;
        nothing louder explains the exit, so its own words settle it."""
        warning = (
            "WARNING 06-13 11:42:20 _custom_ops.py:11] Failed to import from vllm._C with "
            "ImportError('/v/vllm/_C.abi3.so: undefined symbol: _ZN5torch7Library')"
        )
        verdict = _judge(empty, [warning, f"{V1}EngineCore failed to start."])
        assert verdict.root_cause is not None and "undefined symbol" in verdict.root_cause
        assert verdict.severity is Severity.FATAL
        assert verdict.severity_reason is not None
        assert "words 'undefined symbol'" in verdict.severity_reason

    def test_a_caught_import_warning_ranks_below_the_error(self, table: SignatureTable) -> None:
        """vLLM prints `Failed to import from vllm._C ...` (unlevelled here) and goes on: even
        matched by a fatal signature it ranks below the exception that ended the start."""
        without_noise = SignatureTable(
            [s for s in table.signatures if s.id != "noise_vllm_c_module_missing"]
        )
        verdict = _judge(
            without_noise,
            [
                "Failed to import from vllm._C: ModuleNotFoundError(\"No module named 'vllm._C'\")",
                *_traceback(
                    LOADER,
                    exception="RuntimeError: Failed to infer device type, please set the "
                    "environment variable `VLLM_LOGGING_LEVEL=DEBUG`",
                ),
            ],
        )
        assert verdict.root_cause is not None
        assert verdict.root_cause.startswith("RuntimeError: Failed to infer device type")

    def test_a_bare_failure_is_a_wrapper(self, empty: SignatureTable) -> None:
        """`RuntimeError: Executor failed.` says only that something failed: the worker's
        death logged before it is the cause."""
        died = "Worker proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down."
        verdict = _judge(
            empty,
            [
                f"{V1}{died}",
                *_traceback(LOADER, exception="RuntimeError: Executor failed."),
            ],
        )
        assert verdict.root_cause == died

    def test_a_warning_that_reports_a_death_is_a_wrapper_too(self, empty: SignatureTable) -> None:
        """The engine core SIGKILLed: the API server warns that it exited unexpectedly, then
        errs that its output handler failed. Both only report; the first report is the cause."""
        api = "(APIServer pid=358) {} 12-01 09:28:22 [core_client.py:817] {}"
        verdict = _judge(
            empty,
            [
                api.format("WARNING", "[shutdown] MPClient: engine core exited unexpectedly"),
                api.format("ERROR", "AsyncLLM output_handler failed."),
            ],
        )
        assert verdict.root_cause == "[shutdown] MPClient: engine core exited unexpectedly"
        assert (verdict.severity, verdict.confidence) == (Severity.UNKNOWN, "low")

    def test_an_exception_ending_in_a_colon_continues_below(self, empty: SignatureTable) -> None:
        """tvm's `Check failed: (...) is false:` is followed by what failed."""
        verdict = _judge(
            empty,
            [
                "tvm.error.InternalError: Check failed: (status == cudaSuccess) is false:",
                "  BatchPrefillWithPagedKVCache failed with error invalid resource handle",
            ],
        )
        assert verdict.root_cause == (
            "tvm.error.InternalError: Check failed: (status == cudaSuccess) is false: "
            "BatchPrefillWithPagedKVCache failed with error invalid resource handle"
        )


class TestRepetitionAndSafety:
    def test_a_cut_traceback_in_a_check_function_halts_on_the_first_start(
        self, empty: SignatureTable
    ) -> None:
        """A cut traceback in a `_check_*` function before the server served, nothing the
        other way: where it was raised and when settle it, the first crash halts."""
        texts = _traceback(
            (
                f'File "{SITE}/vllm/worker/worker.py", line 231, in _check_if_gpu_supports_dtype',
                "x",
            ),
            exception=None,
        )
        classifier, policy = Classifier(empty), RestartPolicy()
        actions = []
        for n in range(2):
            invocation = failed_invocation(texts, invocation_id=f"{n:032x}")
            verdict, phase = judge(classifier, invocation, GOOD_START_S)
            actions.append(policy.decide(invocation, verdict, Evidence(phase=phase)).action)
        assert actions == [Action.HALT, Action.HALT]

    def test_a_kill_from_outside_is_no_deterministic_crash(self, empty: SignatureTable) -> None:
        """An error line worded deterministic, then the main process SIGKILLed (the OOM killer
        under a neighbour's load): the evidence disagrees, nothing is inferred."""
        verdict = _judge(
            empty,
            [f"{V1}ValueError: dtype must be float16 for this kernel"],
            exit_code="killed",
            exit_status=9,
        )
        assert verdict.severity is Severity.UNKNOWN
        assert verdict.severity_reason is not None and "killed by SIGKILL" in (
            verdict.severity_reason
        )

    def test_a_catch_all_signature_gives_way_to_its_words(self, table: SignatureTable) -> None:
        """`cuda_error_other` (any CUDA error, transient) before serving: 'no kernel image is
        available' says fatal; an illegal memory access says nothing and keeps the table's
        word."""
        no_kernel = _judge(
            table,
            [
                f"{V1}torch.AcceleratorError: CUDA error: no kernel image is available for "
                "execution on the device"
            ],
        )
        assert (no_kernel.severity, no_kernel.basis) == (Severity.FATAL, "inferred")
        assert no_kernel.severity_reason is not None
        assert "catch-all 'cuda_error_other'" in no_kernel.severity_reason
        illegal = _judge(
            table, [f"{V1}torch.AcceleratorError: CUDA error: an illegal memory access"]
        )
        assert (illegal.severity, illegal.basis) == (Severity.TRANSIENT, "signature")

    def test_after_serving_only_transient_is_inferred(self, empty: SignatureTable) -> None:
        """After serving, deterministic words prove nothing (the load decides); a timeout still
        reads transient."""
        served = {"served_us": 100_000_000, "ended_us": 4_000_000_000}
        det = _judge(empty, [SERVING, f"{V1}ValueError: dtype must be float16"], **served)
        timeout = _judge(empty, [SERVING, f"{V1}TimeoutError: the RPC timed out"], **served)
        assert Severity.UNKNOWN is det.severity
        assert Severity.TRANSIENT is timeout.severity

    def test_a_timeout_after_serving_names_the_cause(self, empty: SignatureTable) -> None:
        """SGLang's unlevelled `Watchdog timeout` after serving is the root cause; read after
        the server took requests, it is no evidence, so nothing is inferred from it."""
        verdict = _judge(
            empty,
            [
                SERVING,
                "[2025-03-09 00:57:15 TP4] Watchdog timeout (self.watchdog_timeout=300)",
                "[2025-03-09 00:57:20] Received sigquit from a child process.",
                "Killed",
            ],
            served_us=100_000_000,
            ended_us=4_000_000_000,
        )
        assert verdict.root_cause == "Watchdog timeout (self.watchdog_timeout=300)"
        assert (verdict.severity, verdict.leaning) == (Severity.UNKNOWN, Severity.TRANSIENT)

    @settings(max_examples=80, deadline=None)
    @given(
        words=st.sampled_from(
            (
                "is not supported",
                "out of memory",
                "does not match",
                "cannot find the model weights",
                "undefined symbol: _ZN5torch",
                "must be divisible by 2",
            )
        ),
        level=st.sampled_from(("INFO", "WARNING", "")),
    )
    def test_a_line_after_serving_is_no_lexicon_evidence(
        self, empty: SignatureTable, words: str, level: str
    ) -> None:
        """A quieter line once the server took requests (a client may have put any words in
        it) never becomes the cause by its words, and nothing is inferred fatal."""
        line = f"{level} 12-01 10:05:02 [logger.py:43] prompt: 'x {words}'" if level else words
        verdict = _judge(
            empty,
            [SERVING, line],
            served_us=100_000_000,
            ended_us=150_000_000,
        )
        assert verdict.root_cause != line and (verdict.root_cause or "").find(words) < 0
        assert verdict.severity is not Severity.FATAL

    @settings(max_examples=60, deadline=None)
    @given(texts=st.lists(st.text(max_size=120), max_size=12))
    def test_every_assessed_crash_names_its_evidence(
        self, empty: SignatureTable, texts: list[str]
    ) -> None:
        """Whatever the lines, an inferred or unknown crash's reason lists the evidence."""
        invocation: Invocation = failed_invocation(texts)
        verdict, _ = judge(Classifier(empty), invocation, GOOD_START_S)
        if verdict.basis in ("inferred", "unknown"):
            assert verdict.severity_reason is not None
            assert "evidence: " in verdict.severity_reason


class TestACauseRightBeforeABareExit:
    """A warning or unlevelled line, printed before the start ended with its own exit status
    and with nothing louder after it, is the program saying what is wrong (issue 23: "warnings
    that name a fatal cause right before a bare exit")."""

    LINE = (
        "flashinfer-cubin version (0.6.3) does not match flashinfer version (0.6.4). Please "
        "install the same version of both packages."
    )

    def test_strong_deterministic_words_settle_it(self, empty: SignatureTable) -> None:
        verdict = _judge(empty, [self.LINE])
        assert verdict.severity is Severity.FATAL
        assert verdict.severity_reason is not None
        assert "words 'does not match'" in verdict.severity_reason
        assert "nothing louder explains the exit" in verdict.severity_reason

    def test_a_kill_from_outside_settles_nothing(self, empty: SignatureTable) -> None:
        verdict = _judge(empty, [self.LINE], exit_code="killed", exit_status=9)
        assert verdict.severity is not Severity.FATAL

    def test_a_word_the_other_way_settles_nothing(self, empty: SignatureTable) -> None:
        verdict = _judge(empty, [f"{self.LINE} Connection reset by peer while checking."])
        assert verdict.severity is not Severity.FATAL

    def test_after_serving_it_settles_nothing(self, empty: SignatureTable) -> None:
        served = {"served_us": 100_000_000, "ended_us": 4_000_000_000}
        verdict = _judge(empty, [SERVING, self.LINE], **served)
        assert verdict.severity is not Severity.FATAL

    @settings(max_examples=150, deadline=None)
    @given(text=st.text(min_size=1, max_size=200))
    def test_a_killed_start_is_never_fatal_by_a_quiet_line(
        self, empty: SignatureTable, text: str
    ) -> None:
        verdict = _judge(empty, [text, self.LINE], exit_code="killed", exit_status=9)
        assert verdict.severity is not Severity.FATAL


class TestTheLastWarningBeforeABareExit:
    """A start that printed no error line at all and stopped with an exit status of its own:
    its last warning, when its words name a cause, is what the program said was wrong (TGI's
    launcher: `WARN ... Could not import Flash Attention enabled models: CUDA is not
    available`, then nothing). A warning with no such words, or information, stays a guess."""

    WARNED = (
        "2023-07-27T17:29:53.881747Z  WARN text_generation_launcher: Could not import Flash "
        "Attention enabled models: CUDA is not available"
    )
    INFO = "2023-07-27T17:29:20.717161Z  INFO shard-manager: text_generation_launcher: Starting"

    def test_its_words_settle_it(self, empty: SignatureTable) -> None:
        verdict = _judge(empty, [self.INFO, self.WARNED, self.INFO])
        assert verdict.severity is Severity.FATAL
        assert verdict.root_cause is not None and "CUDA is not available" in verdict.root_cause
        assert "the last warning, whose words name one" in verdict.notes[-1]

    def test_information_in_the_same_words_stays_a_guess(self, empty: SignatureTable) -> None:
        verdict = _judge(empty, [self.INFO, self.WARNED.replace(" WARN ", " INFO ")])
        assert verdict.severity is not Severity.FATAL

    def test_a_warning_that_names_no_cause_stays_a_guess(self, empty: SignatureTable) -> None:
        line = self.WARNED.replace("Could not import", "Skipped").replace("is not", "is")
        verdict = _judge(empty, [self.INFO, line.replace("Attention", "Attention failed")])
        assert verdict.severity is not Severity.FATAL

    def test_a_kill_from_outside_settles_nothing(self, empty: SignatureTable) -> None:
        verdict = _judge(empty, [self.WARNED], exit_code="killed", exit_status=9)
        assert verdict.severity is not Severity.FATAL

    def test_after_serving_it_settles_nothing(self, empty: SignatureTable) -> None:
        served = {"served_us": 100_000_000, "ended_us": 4_000_000_000}
        verdict = _judge(empty, [SERVING, self.WARNED], **served)
        assert verdict.severity is not Severity.FATAL

    def test_a_louder_line_is_the_cause(self, empty: SignatureTable) -> None:
        error = "2023-07-27T17:29:54.000000Z ERROR text_generation_launcher: Shard 0 failed"
        verdict = _judge(empty, [self.WARNED, error])
        assert verdict.root_cause is not None and "Shard 0 failed" in verdict.root_cause


class TestNcclReportsFailuresAtWarn:
    def test_its_warn_before_a_wrapper_is_the_cause(self) -> None:
        """NCCL logs at INFO and WARN only: its WARN naming a failed connection, then the
        scheduler's generic wrapper over a traceback cut short, names the cause (the table
        knows the wrapper and no NCCL message here)."""
        sglang_only = load_signature_table().subset(["sglang"])
        lines = [
            "node-1:139:1092 [7] socket.c:485 NCCL WARN socketStartConnect: Connect to "
            "10.0.0.82<38455> failed : Software caused connection abort",
            "node-1:139:1092 [7] NCCL INFO transport/net.cc:687 -> 2",
            "[2025-04-21 07:28:41 TP0] Scheduler hit an exception: Traceback (most recent call "
            "last):",
            '  File "/sglang/srt/managers/scheduler.py", line 1714, in run_scheduler_process',
        ]
        verdict = _judge(sglang_only, lines)
        assert verdict.root_cause is not None
        assert "socketStartConnect: Connect to 10.0.0.82<38455> failed" in verdict.root_cause
        assert verdict.severity is not Severity.FATAL  # a connection's failure: not fatal


class TestANativeAssertion:
    """A C or C++ assertion that aborted the process (ggml's GGML_ASSERT, glibc's assert,
    glog's CHECK) is an AssertionError in all but name: the cause, not the debugger's chatter
    after it, and fatal before the server ever served."""

    GGML = (
        "/src/llama.cpp/src/llama-context.cpp:2273: GGML_ASSERT(n_outputs_max <= "
        "cparams.n_outputs_max) failed"
    )
    AFTER = (
        "gdb: warning: Couldn't determine a path for the index cache directory.",
        "#1  0x0000563e067db3bb in ggml_print_backtrace ()",
    )

    @pytest.mark.parametrize(
        "line",
        [
            GGML,
            "llama-server: ggml.c:1234: ggml_new_tensor_impl: Assertion `n_dims <= 4' failed.",
            "Check failed: (status == cudaSuccess) is false: invalid resource handle",
            # libzmq's zmq_assert and errno_assert (vLLM's ZMQ sockets under LimitNOFILE=16:
            # corpus 511, recorded here), then abort()
            "Assertion failed: check () (src/msg.cpp:347)",
            "Too many open files (src/epoll.cpp:38)",
        ],
    )
    def test_it_is_the_cause_and_fatal_before_serving(
        self, empty: SignatureTable, line: str
    ) -> None:
        verdict = _judge(empty, [line, *self.AFTER], exit_code="killed", exit_status=6)
        assert verdict.root_cause == line
        assert verdict.severity is Severity.FATAL
        assert verdict.severity_reason is not None and "AssertionError" in verdict.severity_reason

    def test_after_serving_it_is_not_fatal(self, empty: SignatureTable) -> None:
        served = {"served_us": 100_000_000, "ended_us": 4_000_000_000}
        verdict = _judge(empty, [SERVING, self.GGML], **served)
        assert verdict.root_cause == self.GGML
        assert verdict.severity is not Severity.FATAL

    @pytest.mark.parametrize(
        "line",
        [
            "the health check failed",
            "loaded weights (model.py:12)",  # a Python file's place: not a native assertion
            "listening on 8080 (src/main.rs:12)",  # Rust: its panics have their own form
        ],
    )
    def test_the_words_alone_are_no_assertion(self, empty: SignatureTable, line: str) -> None:
        verdict = _judge(empty, [line])
        assert verdict.severity_reason is None or "AssertionError" not in verdict.severity_reason


class TestALineThatSaysItCoped:
    """SGLang prints `Ignore import error when loading <model>: cannot import name ...` at every
    start and goes on: a signature that knows the import's words does not make it the cause of
    a kill while serving (recorded here: corpus 380, 381, 384 were halted so at first)."""

    IGNORED = (
        "[2026-12-05 07:31:40] Ignore import error when loading sglang.srt.models.falcon_mamba: "
        "cannot import name 'causal_conv1d_fn' from 'sglang.srt.layers.attention.mamba.mamba'"
    )
    CRASHED = "[2026-12-05 07:32:01] Subprocess scheduler_0 (pid=2220) crashed with exit code -9."

    def test_it_is_not_the_cause_nor_fatal(self) -> None:
        served = {"served_us": 100_000_000, "ended_us": 130_000_000}
        verdict = _judge(load_signature_table(), [self.IGNORED, SERVING, self.CRASHED], **served)
        assert verdict.root_cause is not None and "crashed with exit code -9" in verdict.root_cause
        assert verdict.severity is not Severity.FATAL
        assert verdict.signature != "import_name_missing"

    def test_alone_it_is_named_but_decides_nothing(self) -> None:
        verdict = _judge(load_signature_table(), [self.IGNORED])
        assert verdict.root_cause == self.IGNORED.split("] ", 1)[1]
        assert verdict.severity is not Severity.FATAL
        assert verdict.signature is None


class TestAnEngineThatKillsItself:
    """SGLang's launcher kills its own process tree with SIGKILL when a child fails, after
    saying so: systemd's `killed:9` is then its own end, and the child's error decides (corpus
    375). Without the engine's words the same ending is a kill from outside."""

    LINES = (
        "AssertionError: SGLANG_CPU_OMP_THREADS_BIND is not set, in this case, the total number "
        "of ranks (dp_size * tp_size * pp_size = 3) should be smaller than or equal to number of "
        "numa node on the machine 1.",
        "[2026-12-05 07:28:56] Received sigquit from a child process. It usually means the child "
        "failed.",
        "[2026-12-05 07:28:56] kill_process_tree called: parent_pid=324, include_parent=True, "
        "pid=324",
    )

    def test_its_own_sigkill_leaves_the_cause_to_decide(self, empty: SignatureTable) -> None:
        verdict = _judge(empty, list(self.LINES), exit_code="killed", exit_status=9)
        assert verdict.severity is Severity.FATAL
        assert verdict.root_cause is not None and "AssertionError" in verdict.root_cause

    def test_without_its_words_the_kill_is_from_outside(self, empty: SignatureTable) -> None:
        verdict = _judge(empty, list(self.LINES[:1]), exit_code="killed", exit_status=9)
        assert verdict.severity is not Severity.FATAL

    def test_a_cleanup_of_its_children_is_no_self_kill(self, empty: SignatureTable) -> None:
        lines = [
            self.LINES[0],
            self.LINES[2].replace("include_parent=True", "include_parent=False"),
        ]
        verdict = _judge(empty, lines, exit_code="killed", exit_status=9)
        assert verdict.severity is not Severity.FATAL


class TestAReraiseThatSaysWhy:
    """An exception whose words say nothing of why, re-raised as one whose words do: the
    re-raise is named (transformers over a JSONDecodeError: corpus 230, 377)."""

    def _chain(self, inner: str, outer: str) -> list[str]:
        return [
            "Traceback (most recent call last):",
            '  File "/v/json/decoder.py", line 353, in raw_decode',
            "    obj, end = self.scan_once(s, idx)",
            inner,
            "",
            "During handling of the above exception, another exception occurred:",
            "",
            "Traceback (most recent call last):",
            '  File "/v/transformers/configuration_utils.py", line 742, in _get_config_dict',
            "    raise OSError(",
            outer,
        ]

    def test_the_file_it_names_is_the_cause(self, empty: SignatureTable) -> None:
        outer = (
            "OSError: It looks like the config file at '/m/config.json' is not a valid JSON file."
        )
        lines = self._chain("json.decoder.JSONDecodeError: Unterminated string starting at: "
                            "line 17 column 3 (char 349)", outer)  # fmt: skip
        assert _judge(empty, lines).root_cause == outer

    def test_an_inner_that_says_why_stays(self, empty: SignatureTable) -> None:
        inner = "httpx.ReadError: [Errno 104] Connection reset by peer"
        lines = self._chain(inner, "OSError: Can't load the configuration of 'org/model'.")
        assert _judge(empty, lines).root_cause == inner


class TestWhereAStartupCrashWasRaised:
    """A traceback cut before its exception line, before the server served: its innermost
    frame in deterministic code (model loading, kernels, configuration, a check) and no clue
    the other way settles it; in distributed or network code it does not."""

    def test_model_loading_settles_it(self, empty: SignatureTable) -> None:
        verdict = _judge(empty, _traceback(LOADER, exception=None))
        assert verdict.severity is Severity.FATAL
        assert verdict.severity_reason is not None
        assert "raised in" in verdict.severity_reason

    def test_distributed_code_does_not(self, empty: SignatureTable) -> None:
        frame = (
            f'File "{SITE}/torch/distributed/distributed_c10d.py", line 4010, in barrier',
            "work = group.barrier(opts=opts)",
        )
        verdict = _judge(empty, _traceback(LOADER, frame, exception=None))
        assert verdict.severity is not Severity.FATAL

    def test_after_serving_it_does_not(self, empty: SignatureTable) -> None:
        served = {"served_us": 100_000_000, "ended_us": 4_000_000_000}
        verdict = _judge(empty, [SERVING, *_traceback(LOADER, exception=None)], **served)
        assert verdict.severity is not Severity.FATAL

    def test_a_kill_from_outside_does_not(self, empty: SignatureTable) -> None:
        verdict = _judge(
            empty, _traceback(LOADER, exception=None), exit_code="killed", exit_status=9
        )
        assert verdict.severity is not Severity.FATAL


class TestHowAKillReads:
    """systemd says how the main process ended: `code=killed, status=9/KILL` alone is someone's
    signal (a person, an orchestrator); its OOM-kill message (MESSAGE_ID fe6faa94...) says the
    unit's memory ran out. Before the server ever served that is the load's peak, met again."""

    LOADING = (
        "(EngineCore_DP0 pid=563) INFO 12-23 23:34:23 [loader.py:267] Loading weights took 41 s",
        "(EngineCore_DP0 pid=563) INFO 12-23 23:34:24 [worker.py:298] Memory profiling ...",
    )

    def _loop(self, empty: SignatureTable, served: bool, **ended: object) -> list[Action]:
        classifier, policy = Classifier(empty), RestartPolicy()
        actions = []
        for n in range(3):
            texts = [SERVING, *self.LOADING] if served else list(self.LOADING)
            started = failed_invocation(
                texts, invocation_id=f"{n:032x}", served_us=1_000_000 if served else None
            )
            invocation = dataclasses.replace(
                started,
                **ended,  # type: ignore[arg-type]
            )
            verdict, phase = judge(classifier, invocation, GOOD_START_S)
            actions.append(policy.decide(invocation, verdict, Evidence(phase=phase)).action)
        return actions

    def test_an_oom_kill_while_loading_leans_fatal(self, empty: SignatureTable) -> None:
        """The OOM killer at the same point of two starts' load halts the second."""
        oom = {"oom_killed": True, "exit_code": "killed", "exit_status": 9, "result": "oom-kill"}
        verdict = _judge(empty, list(self.LOADING), **oom)
        assert verdict.severity is Severity.UNKNOWN
        assert verdict.leaning is Severity.FATAL
        assert verdict.severity_reason is not None
        assert "OOM killer before the server ever served" in verdict.severity_reason
        assert self._loop(empty, False, **oom)[:2] == [Action.ALLOW_RESTART, Action.HALT]

    def test_an_oom_kill_after_serving_is_transient(self, empty: SignatureTable) -> None:
        """After serving, memory is the load's: restarted every time."""
        oom = {"oom_killed": True, "exit_code": "killed", "exit_status": 9, "result": "oom-kill"}
        assert Action.HALT not in self._loop(empty, True, **oom)

    def test_a_bare_sigkill_is_never_halted(self, empty: SignatureTable) -> None:
        """`code=killed, status=9/KILL` with no OOM message, in every start: someone's signal,
        not a crash of the start; never halted, however often it repeats (paced from the
        second)."""
        killed = {"exit_code": "killed", "exit_status": 9, "result": "signal"}
        verdict = _judge(empty, list(self.LOADING), **killed)
        assert verdict.severity is Severity.TRANSIENT
        assert self._loop(empty, False, **killed) == [Action.ALLOW_RESTART] + [Action.HOLD] * 2

    def test_systemds_own_start_timeout_is_no_outside_kill(self, empty: SignatureTable) -> None:
        """TimeoutStartSec= ran out and systemd killed the start (result 'timeout'): the same
        load takes as long again, so the kill is no sign a restart helps; the repeat rule
        halts it."""
        timeout = {"exit_code": "killed", "exit_status": 9, "result": "timeout"}
        verdict = _judge(empty, list(self.LOADING), **timeout)
        assert verdict.severity is Severity.UNKNOWN
        assert self._loop(empty, False, **timeout) == [
            Action.ALLOW_RESTART,
            Action.HOLD,  # paced, until the repeat rule settles it
            Action.HALT,
        ]
