"""Prefix stripping for every log format in the corpus README, and traceback reassembly."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.classify.logline import (
    Role,
    annotate,
    carried_cause,
    exception_name,
    is_native_assert,
    parse_line,
    parse_lines,
)
from vllm_supervisor.model import LogLine

# (raw line, journal pid, expected text, expected process, expected level)
PREFIXES = [
    # systemd journal (syslog export) + vLLM v1 process tag.
    (
        "Aug 19 18:34:27 vllm vllm[8727]: (EngineCore pid=8727)     return _inner(*args)",
        None,
        "    return _inner(*args)",
        "pid:8727",
        None,
    ),
    # vLLM v1 API server logger line.
    (
        "(APIServer pid=1) INFO 08-25 12:24:24 [loggers.py:123] Engine 000: Avg prompt",
        None,
        "Engine 000: Avg prompt",
        "pid:1",
        "INFO",
    ),
    # vLLM v1 engine core with DP suffix.
    (
        "(EngineCore_DP0 pid=563) ERROR 12-23 23:34:23 [core.py:708] EngineCore failed to start.",
        None,
        "EngineCore failed to start.",
        "pid:563",
        "ERROR",
    ),
    # Worker tags: `VllmWorker TP0`, `Worker_TP1`, vLLM 0.8 `rank=4`.
    (
        "(VllmWorker TP0 pid=405) INFO 08-25 12:24:19 [multiproc_executor.py:520] Parent exited",
        None,
        "Parent exited",
        "pid:405",
        "INFO",
    ),
    (
        "(VllmWorker rank=4 pid=907) Process SpawnProcess-1:5:",
        None,
        "Process SpawnProcess-1:5:",
        "pid:907",
        None,
    ),
    # Double prefix: the child's tag wins.
    (
        "(APIServer pid=1) (EngineCore_DP0 pid=68) ERROR 02-06 16:34:06 [core.py:936] boom",
        None,
        "boom",
        "pid:68",
        "ERROR",
    ),
    # vLLM V0 without brackets.
    (
        "INFO 01-11 15:51:02 llm_engine.py:70] Initializing an LLM engine",
        None,
        "Initializing an LLM engine",
        None,
        "INFO",
    ),
    (
        "(VllmWorkerProcess pid=6499) ERROR 07-24 14:07:40 multiproc_worker_utils.py:226] "
        "ValueError: x",
        None,
        "ValueError: x",
        "pid:6499",
        "ERROR",
    ),
    # torch elastic rank prefix.
    (
        "[rank0]: Traceback (most recent call last):",
        None,
        "Traceback (most recent call last):",
        "rank0",
        None,
    ),
    # Ray with ANSI remnants and the dedup suffix.
    (
        "[36m(RayWorkerWrapper pid=813)[0m WARNING 04-17 13:56:04 triton_decode_attention.py:44] "
        "Ignore me.[32m [repeated 14x across cluster][0m",
        None,
        "Ignore me.",
        "pid:813",
        "WARNING",
    ),
    (
        "\x1b[36m(RayWorkerVllm pid=5085)\x1b[0m [E ProcessGroupNCCL.cpp:475] [Rank 4] Watchdog",
        None,
        "[Rank 4] Watchdog",
        "pid:5085",
        "ERROR",
    ),
    # docker compose service column.
    (
        "eap-llm-server-on-arc  | ERROR 11-08 11:01:29 [multiproc_executor.py:135] Worker died",
        None,
        "Worker died",
        None,
        "ERROR",
    ),
    # Cloud export: a bare ISO timestamp line.
    ("2026-02-14T02:05:12.788Z", None, "", None, None),
    # Container runtime timestamp + Ray actor + vLLM V0.
    (
        "2024-06-28T06:11:52.685300953Z (LLMRayActor pid=20770) INFO 06-28 06:11:45 "
        "distributed_gpu_executor.py:45] # GPU blocks: 378",
        None,
        "# GPU blocks: 378",
        "pid:20770",
        "INFO",
    ),
    # Ray Data triple prefix with nested parentheses.
    (
        "2026-03-09 01:27:30.122744672 (MapWorker(MapBatches(vLLMEngineActor)) pid=1202, "
        "ip=10.53.120.118) (EngineCore_DP0 pid=32080) INFO 03-08 17:27:28 [shm_broadcast.py:548] "
        "No available shared memory broadcast block found in 60 seconds.",
        None,
        "No available shared memory broadcast block found in 60 seconds.",
        "pid:32080",
        "INFO",
    ),
    # Custom Python logging with CR as pasted (`^M`).
    (
        "2024-12-19 21:40:35 ERROR 56542 [async_llm_engine.py:64] RuntimeError: boom^M",
        None,
        "RuntimeError: boom",
        "pid:56542",
        "ERROR",
    ),
    (
        "INFO 02-03 13:14:04 llm_engine.py:706] Avg throughput\r\n",
        None,
        "Avg throughput",
        None,
        "INFO",
    ),
    # SGLang, with and without DP.
    (
        "[2025-08-06 20:26:20 TP0] Scheduler hit an exception: x",
        None,
        "Scheduler hit an exception: x",
        "TP0",
        None,
    ),
    (
        "[2025-07-02 07:41:59 DP7 TP7] max_total_tokens=131072 is larger",
        None,
        "max_total_tokens=131072 is larger",
        "DP7 TP7",
        None,
    ),
    # TGI launcher with spans and targets.
    (
        "2024-03-06T17:53:31.052444Z ERROR shard-manager: text_generation_launcher: Shard process "
        "was signaled to shutdown with signal 4 rank=0",
        None,
        "Shard process was signaled to shutdown with signal 4 rank=0",
        None,
        "ERROR",
    ),
    (
        "2024-10-05T16:06:53.739391Z ERROR warmup{max_input_length=4095}:warmup: "
        "text_generation_router_v3::client: backends/v3/src/client/mod.rs:54: "
        "Server error: CANCELLED",
        None,
        "Server error: CANCELLED",
        None,
        "ERROR",
    ),
    # NCCL debug lines, with and without a bracket timestamp. NCCL has no error level: its
    # WARN is the report of a failure.
    (
        "[2026-05-22 10:26:17] d4fde3314201:13740:13740 [7] misc/shmutils.cc:132 NCCL WARN Error",
        None,
        "NCCL WARN Error",
        "pid:13740",
        "ERROR",
    ),
    (
        "DG-DGX6:1458:1553 [6] NCCL INFO [Service thread] x",
        None,
        "NCCL INFO [Service thread] x",
        "pid:1458",
        "INFO",
    ),
    # glog from torch.
    (
        "W1223 23:34:22.775000 1116 torch/utils/cpp_extension.py:2425] "
        "TORCH_CUDA_ARCH_LIST is not set",
        None,
        "TORCH_CUDA_ARCH_LIST is not set",
        "pid:1116",
        "WARNING",
    ),
    # c10d with a rank prefix.
    (
        "[rank8]:[W1230 23:19:23.970692304 ProcessGroupNCCL.cpp:1250] Warning: WARNING: x",
        None,
        "Warning: WARNING: x",
        "rank8",
        "WARNING",
    ),
    # Kernel lines.
    (
        "kernel: NVRM: Xid (PCI:0000:dc:00): 45, pid=1",
        None,
        "NVRM: Xid (PCI:0000:dc:00): 45, pid=1",
        None,
        None,
    ),
    (
        "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0",
        None,
        "NVRM: The NVIDIA GPU 0000:b3:00.0",
        None,
        None,
    ),
    (
        "Aug 19 18:34:27 host kernel: NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
        None,
        "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
        None,
        None,
    ),
    # Raylet line nested inside the API server's tag.
    (
        "(APIServer pid=132135) (raylet) [2025-12-23 23:06:29,336 E 133251 133275] (raylet) "
        "file_system_monitor.cc:116: /tmp/ray is over 95% full",
        None,
        "file_system_monitor.cc:116: /tmp/ray is over 95% full",
        "raylet",
        "ERROR",
    ),
    # Ray's own logger.
    (
        "2025-03-21 19:23:35,946 INFO compiled_dag_node.py:2115 -- Cancelling compiled worker",
        None,
        "Cancelling compiled worker",
        None,
        "INFO",
    ),
    # Ray's own log file: a tab after the time.
    (
        "2025-03-19 14:58:50,134\tINFO node.py:1084 -- Can't find a `node_ip_address.json` file",
        None,
        "Can't find a `node_ip_address.json` file",
        None,
        "INFO",
    ),
    # Plain traceback line: indentation is kept; the journal pid is the fallback process.
    ('  File "/x/y.py", line 3, in f', 4242, '  File "/x/y.py", line 3, in f', "pid:4242", None),
    # Code with a pipe is not a docker-compose column.
    ("    flags = a | b", None, "    flags = a | b", None, None),
]


class TestPrefixes:
    @pytest.mark.parametrize(("raw", "pid", "text", "process", "level"), PREFIXES)
    def test_prefix_is_stripped(
        self, raw: str, pid: int | None, text: str, process: str | None, level: str | None
    ) -> None:
        """Each corpus prefix format yields the bare text, the process key and the level."""
        parsed = parse_line(LogLine(text=raw, pid=pid))
        assert (parsed.text, parsed.process, parsed.level) == (text, process, level)

    def test_parse_lines_matches_parse_line(self) -> None:
        """The prefix-reusing batch parser gives the same result as parsing lines one by one."""
        lines = [LogLine(text=raw, pid=pid) for raw, pid, *_ in PREFIXES]
        repeated = [
            LogLine(text="(EngineCore pid=7) ERROR 01-01 00:00:00 [core.py:1] " + tail)
            for tail in ("Traceback (most recent call last):", '  File "a.py", line 1, in f', "X")
        ]
        batch = lines + repeated + lines
        assert parse_lines(batch) == [parse_line(line) for line in batch]

    def test_priority_gives_error_level(self) -> None:
        """A journal priority of err or worse marks an unprefixed line as ERROR."""
        assert parse_line(LogLine(text="boom", priority=3)).level == "ERROR"
        assert parse_line(LogLine(text="boom", priority=6)).level is None


def _roles(texts: list[str]) -> list[Role]:
    return annotate([LogLine(text=t) for t in texts]).roles


class TestTracebacks:
    def test_roles_of_a_traceback(self) -> None:
        """Header, frames, code, exception and its detail lines are told apart."""
        roles = _roles(
            [
                "Traceback (most recent call last):",
                '  File "/x/a.py", line 1, in f',
                "    g()",
                "    ^^^",
                "RuntimeError: CUDA error: boom",
                "CUDA kernel errors might be asynchronously reported",
                "",
                "next message",
            ]
        )
        assert roles == [
            Role.HEADER,
            Role.FRAME,
            Role.CODE,
            Role.CODE,
            Role.EXCEPTION,
            Role.DETAIL,
            Role.BLANK,
            Role.MESSAGE,
        ]

    def test_chained_tracebacks_are_linked(self) -> None:
        """The traceback after 'direct cause' records the block it was raised from."""
        ann = annotate(
            [
                LogLine(text=t)
                for t in [
                    "Traceback (most recent call last):",
                    '  File "a.py", line 1, in f',
                    "KeyError: 'x'",
                    "",
                    "The above exception was the direct cause of the following exception:",
                    "",
                    "Traceback (most recent call last):",
                    '  File "b.py", line 2, in g',
                    "RuntimeError: wrapped",
                ]
            ]
        )
        assert len(ann.blocks) == 2
        assert ann.blocks[1].chained_from == 0
        assert ann.roles[4] is Role.CHAIN

    def test_interleaved_workers_are_separated(self) -> None:
        """Two workers' tracebacks interleaved line by line form two blocks, one per process."""
        a = "(Worker_TP0 pid=11) ERROR 10-06 22:12:39 [multiproc_executor.py:597] "
        b = "(Worker_TP1 pid=12) ERROR 10-06 22:12:39 [multiproc_executor.py:597] "
        texts = []
        for line in [
            "Traceback (most recent call last):",
            '  File "x.py", line 1, in f',
            "    f()",
            "ValueError: boom",
        ]:
            texts += [a + line, b + line]
        ann = annotate([LogLine(text=t) for t in texts])
        assert [b.process for b in ann.blocks] == ["pid:11", "pid:12"]
        assert all(len(block.frames) == 1 for block in ann.blocks)
        assert all(block.exception is not None for block in ann.blocks)

    def test_unprefixed_sglang_traceback_joins_its_header(self) -> None:
        """SGLang prints only the first traceback line with a prefix; the rest follow it."""
        ann = annotate(
            [
                LogLine(text=t)
                for t in [
                    "[2025-08-06 20:26:20 TP0] Scheduler hit an exception: "
                    "Traceback (most recent call last):",
                    '  File "/s/scheduler.py", line 2534, in run_scheduler_process',
                    "    scheduler = Scheduler(",
                    "RuntimeError: boom",
                ]
            ]
        )
        assert set(ann.processes) == {"TP0"}
        assert ann.blocks[0].exception == 3

    def test_destructor_traceback_is_ignored(self) -> None:
        """A traceback after 'Exception ignored in' is marked ignored."""
        ann = annotate(
            [
                LogLine(text=t)
                for t in [
                    "Exception ignored in: <function NCCLCommunicator.__del__ at 0x7f4d8c3212d0>",
                    "Traceback (most recent call last):",
                    '  File "pynccl.py", line 264, in __del__',
                    "AttributeError: 'NCCLCommunicator' object has no attribute 'comm'",
                ]
            ]
        )
        assert ann.blocks[0].ignored

    def test_code_without_indentation_is_not_an_exception(self) -> None:
        """A traceback pasted without indentation keeps call lines as code."""
        roles = _roles(
            [
                "Traceback (most recent call last):",
                'File "/opt/vllm/platforms/cuda.py", line 123, in set_device',
                "torch.cuda.set_device(device)",
                "Process EngineCore_DP0:",
            ]
        )
        assert Role.EXCEPTION not in roles


# Lines as a journal holds them: an outer prefix (syslog, a container runtime's time, a CI
# runner's), process tags (vLLM's, Ray's), a logger's prefix, then the message.
OUTER = ("", "Aug 19 18:34:27 host vllm[8727]: ", "2024-06-28T06:11:52.685300953Z ")
TAGS = (
    "(APIServer pid=1) ",
    "(RayWorkerWrapper pid=813, ip=10.0.0.5) ",
    "(EngineCore_DP0 pid=68) ",
)
LOGGERS = (
    ("ERROR 02-06 16:34:06 [core.py:936] ", "ERROR"),
    ("INFO 01-11 15:51:02 llm_engine.py:70] ", "INFO"),
    ("WARNING 06-13 11:42:20 _custom_ops.py:11] ", "WARNING"),
    ("2024-02-20 21:46:23 | ERROR | stderr | ", "ERROR"),
)
# A message starts with a lower-case word, so no prefix family can read it as its own.
MESSAGES = st.from_regex(r"[a-z][a-z0-9 .,:_=()'-]{0,60}", fullmatch=True)
ANSI = ("\x1b[36m", "\x1b[0m", "\x1b[1;31m", "\x1b[0;0m", "[36m", "[0m", "[0;36m", "^[[1;36m")


def _pid(tag: str) -> str:
    match = re.search(r"pid=(\d+)", tag)
    assert match is not None
    return f"pid:{match.group(1)}"


class TestPrefixesAnywhere:
    """ANSI colour codes and process tags wherever they stand among the prefixes."""

    @given(
        outer=st.sampled_from(OUTER),
        tag=st.sampled_from(TAGS),
        logger=st.sampled_from(LOGGERS),
        message=MESSAGES,
    )
    def test_a_process_tag_after_the_logger_prefix(
        self, outer: str, tag: str, logger: tuple[str, str], message: str
    ) -> None:
        """A Ray or vLLM process tag reads the same before and after a logger's prefix."""
        before = parse_line(LogLine(text=f"{outer}{tag}{logger[0]}{message}"))
        after = parse_line(LogLine(text=f"{outer}{logger[0]}{tag}{message}"))
        assert (message, _pid(tag), logger[1]) == (after.text, after.process, after.level)
        assert before == after

    @given(
        outer=st.sampled_from(OUTER),
        tags=st.lists(st.sampled_from(TAGS), max_size=2),
        logger=st.sampled_from(LOGGERS),
        message=MESSAGES,
        codes=st.lists(st.tuples(st.integers(0, 400), st.sampled_from(ANSI)), max_size=6),
    )
    def test_colour_codes_anywhere_change_nothing(
        self,
        outer: str,
        tags: list[str],
        logger: tuple[str, str],
        message: str,
        codes: list[tuple[int, str]],
    ) -> None:
        """ANSI escapes, and their remnants pasted without ESC (with or without a reset), are
        dropped wherever they stand, even inside a prefix or a word."""
        line = f"{outer}{''.join(tags)}{logger[0]}{message}"
        coloured = line
        for position, code in sorted(codes, reverse=True):  # from the end: none lands in another
            at = min(position, len(line))
            coloured = coloured[:at] + code + coloured[at:]
        assert parse_line(LogLine(text=line)) == parse_line(LogLine(text=coloured))
        assert parse_line(LogLine(text=coloured)).text == message

    @pytest.mark.parametrize(
        ("raw", "text", "process", "level"),
        [
            # fastchat's model worker: time, level and stream in pipe-separated columns.
            (
                "qanything-container-local  | 2024-02-20 21:46:23 | ERROR | stderr | [rank0]:   "
                'File "/v/worker.py", line 231, in _check_if_gpu_supports_dtype',
                '  File "/v/worker.py", line 231, in _check_if_gpu_supports_dtype',
                "rank0",
                "ERROR",
            ),
            # Python's warnings module: the location before the category is a prefix.
            (
                "/opt/v/dispatcher.py:138: FutureWarning: `torch.distributed.reduce_op` is "
                "deprecated",
                "FutureWarning: `torch.distributed.reduce_op` is deprecated",
                None,
                "WARNING",
            ),
            # An SGLang prefix, then a Ray tag.
            (
                "[2025-03-10 14:17:52 TP6] (RayWorkerWrapper pid=3) ValueError: bad",
                "ValueError: bad",
                "pid:3",
                None,
            ),
        ],
    )
    def test_other_wrapping_prefixes(
        self, raw: str, text: str, process: str | None, level: str | None
    ) -> None:
        """fastchat's columns, a warning's location and a tag after SGLang's prefix go too."""
        parsed = parse_line(LogLine(text=raw))
        assert (text, process, level) == (parsed.text, parsed.process, parsed.level)


# Causes as a wrapper carries them: an exception's message (str(e), no class) or a whole line.
CAUSES = st.one_of(
    st.sampled_from(
        (
            "CUDA error: invalid device ordinal",
            "NCCL error: unhandled cuda error",
            "Bfloat16 is only supported on GPUs with compute capability of at least 8.0.",
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization`.",
        )
    ),
    MESSAGES.filter(lambda m: m.strip() == m and bool(m)),
)


class TestCarriedCauses:
    """Wrapper lines that carry their cause: the parser hands the cause over."""

    @given(cause=CAUSES, method=st.from_regex(r"[a-z_]{1,30}", fullmatch=True))
    def test_exception_in_worker_while_processing_method(self, cause: str, method: str) -> None:
        """vLLM V0's worker wrapper: `Exception in worker W while processing method M: <cause>,
        Traceback (most recent call last):` carries the cause and opens the traceback."""
        line = (
            f"(VllmWorkerProcess pid=500) ERROR 04-12 05:35:29 [multiproc_worker_utils.py:238] "
            f"Exception in worker VllmWorkerProcess while processing method {method}: {cause}, "
            "Traceback (most recent call last):"
        )
        carried = carried_cause(parse_line(LogLine(text=line)).text)
        assert carried is not None
        assert (cause, f"worker method {method}") == (carried.cause, carried.wrapper)
        assert annotate([LogLine(text=line)]).roles == [Role.HEADER]

    def test_a_worker_wrapper_without_its_cause_carries_none(self) -> None:
        """vLLM 0.7's form ends at the method's name: it carries nothing."""
        text = "Exception in worker VllmWorkerProcess while processing method load_model."
        assert carried_cause(text) is None

    @given(cause=CAUSES, exception=st.sampled_from(("ImportError", "ModuleNotFoundError")))
    def test_failed_to_import_with_an_exception(self, cause: str, exception: str) -> None:
        """`Failed to import from vllm._C with ImportError('...')` carries the ImportError."""
        quote = '"' if "'" in cause else "'"
        for joiner in (" with ", ": "):
            text = f"Failed to import from vllm._C{joiner}{exception}({quote}{cause}{quote})"
            carried = carried_cause(text)
            assert carried is not None
            assert f"{exception}: {cause}" == carried.cause
            assert carried.caught  # vLLM warns and goes on: the line is a warning

    @given(cause=CAUSES, exception=st.sampled_from(("RuntimeError", "ValueError")))
    def test_error_in_model_execution(self, cause: str, exception: str) -> None:
        """vLLM V0 re-raises a model's error as `type(e)(f"Error in model execution (input
        dumped to X): {e}")`: the class and the message are the cause's."""
        for dumped in ("", " (input dumped to /tmp/err_execute_model_input_20250111.pkl)"):
            carried = carried_cause(f"{exception}: Error in model execution{dumped}: {cause}")
            assert carried is not None
            assert f"{exception}: {cause}" == carried.cause

    @given(exception=st.sampled_from(("ValueError", "RuntimeError", "AssertionError")))
    def test_ray_task_error_names_the_class(self, exception: str) -> None:
        """`ray.exceptions.RayTaskError(ValueError): ray::...` names the class raised inside."""
        text = (
            f"ray.exceptions.RayTaskError({exception}): ray::RayWorkerWrapper.execute_method() "
            "(pid=2103, ip=10.0.0.5, actor_id=9f1c)"
        )
        carried = carried_cause(text)
        assert carried is not None
        assert exception == carried.cause

    @given(message=MESSAGES)
    def test_plain_lines_carry_nothing(self, message: str) -> None:
        """A line of no wrapper form carries no cause."""
        assert carried_cause(message) is None

    def test_a_message_that_opens_a_traceback_is_its_intro(self) -> None:
        """`logger.exception("EngineCore failed to start.")` prints its message, then the
        traceback: the message introduces the block (it names no cause of its own)."""
        p = "(EngineCore_DP0 pid=563) ERROR 12-23 23:34:23 [core.py:708] "
        ann = annotate(
            [
                LogLine(text=t)
                for t in (
                    f"{p}Available KV cache memory: -2.77 GiB",
                    f"{p}EngineCore failed to start.",
                    f"{p}Traceback (most recent call last):",
                    f'{p}  File "/v/core.py", line 699, in run_engine_core',
                    "[TP0] Scheduler hit an exception: Traceback (most recent call last):",
                    '  File "/s/scheduler.py", line 2534, in run_scheduler_process',
                )
            ]
        )
        assert [block.intro for block in ann.blocks] == [1, 4]


class TestNativeAssertionForms:
    """libzmq's assertions are a whole line closed by a C or C++ source file's place; any other
    text read for one never fails, and a Python or Rust file's place is not one."""

    @given(
        words=st.from_regex(r"[A-Za-z][A-Za-z0-9 ,'=<>_-]{0,80}[a-z0-9]", fullmatch=True),
        path=st.from_regex(r"(?:[a-z_]{1,8}/){0,3}[a-z_]{1,12}", fullmatch=True),
        suffix=st.sampled_from(("c", "cc", "cpp", "cxx", "hpp")),
        line=st.integers(1, 99_999),
    )
    def test_words_then_a_native_source_place(
        self, words: str, path: str, suffix: str, line: int
    ) -> None:
        text = f"{words} ({path}.{suffix}:{line})"
        assert is_native_assert(text)
        assert exception_name(text) == "AssertionError"
        assert not is_native_assert(f"{words} ({path}.py:{line})")

    @given(st.text(max_size=400))
    def test_no_text_makes_the_reading_fail(self, text: str) -> None:
        assert isinstance(is_native_assert(text), bool)
