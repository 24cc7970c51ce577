"""Nothing a client of the served API can write acts.

Seen on a real vLLM with request logging on: a client sent a prompt holding `EngineDeadError`
and the flashinfer error text; vLLM logs it in the INFO `Received request ... prompt: '...'`
line, so the healthy server was closed as hung, the prompt became the root cause
(`flashinfer_cubin_mismatch`, fatal) and it was quarantined. And one request's error while
serving (uvicorn's `Exception in ASGI application` → `ValueError: Unknown part type`) became the
verdict of the process's later end: 5 of 5 such cases took it as the cause, 3 were halted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from corpus_judge import GOOD_START_S, failed_invocation
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.classify.classifier import Classifier
from vllm_supervisor.classify.determinism import judge
from vllm_supervisor.classify.signatures import SignatureTable, load_signature_table
from vllm_supervisor.commands.demo import demo_config
from vllm_supervisor.config import Config, UnitConfig
from vllm_supervisor.decide.hang import HangDetector, HangWatcher
from vllm_supervisor.decide.policy import RestartPolicy
from vllm_supervisor.environment.execstart import serving_port
from vllm_supervisor.model import Action, Evidence, Invocation, JournalEntry, Severity, UnitState

UNIT = "vllm.service"
INV = "a" * 32
CUBIN = "RuntimeError: flashinfer-cubin version (0.6.3) does not match flashinfer version (0.6.4)"
PROMPT = (
    "INFO 12-01 10:05:02 [logger.py:43] Received request chatcmpl-8f2c: prompt: "
    "'<|user|>\\nvllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\\n"
    f"{CUBIN}\\n<|assistant|>\\n', params: SamplingParams(n=1, temperature=0.7), "
    "prompt_token_ids: None, lora_request: None."
)
SERVING = [
    "INFO 12-01 10:00:00 [api_server.py:1880] vLLM API server version 0.33.0",
    "INFO 12-01 10:03:10 [api_server.py:1951] Starting vLLM API server 0 on http://0.0.0.0:8000",
    "INFO:     Started server process [4242]",
    "INFO:     Waiting for application startup.",
    "INFO:     Application startup complete.",
]
SITE = "/opt/venv/lib/python3.12/site-packages"
ASGI_ERROR = [
    'INFO:     127.0.0.1:40412 - "POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error',
    "ERROR:    Exception in ASGI application",
    "Traceback (most recent call last):",
    f'  File "{SITE}/uvicorn/protocols/http/httptools_impl.py", line 409, in run_asgi',
    "    result = await app(  # type: ignore[func-returns-value]",
    f'  File "{SITE}/fastapi/applications.py", line 1054, in __call__',
    "    await super().__call__(scope, receive, send)",
    f'  File "{SITE}/starlette/routing.py", line 73, in app',
    "    response = await f(request)",
    f'  File "{SITE}/vllm/entrypoints/utils.py", line 97, in wrapper',
    "    return handler_task.result()",
    f'  File "{SITE}/vllm/entrypoints/openai/api_server.py", line 600, in create_chat_completion',
    "    generator = await handler.create_chat_completion(request, raw_request)",
    f'  File "{SITE}/vllm/entrypoints/chat_utils.py", line 1100, in '
    "_parse_chat_message_content_part",
    '    raise ValueError(f"Unknown part type: {part_type}")',
    "ValueError: Unknown part type: input_audio_x",
]
LAZY_IMPORT = [
    "ERROR:    Exception in ASGI application",
    "Traceback (most recent call last):",
    f'  File "{SITE}/uvicorn/protocols/http/httptools_impl.py", line 409, in run_asgi',
    "    result = await app(  # type: ignore[func-returns-value]",
    f'  File "{SITE}/vllm/entrypoints/openai/serving_transcription.py", line 88, in _preprocess',
    "    import librosa",
    "ModuleNotFoundError: No module named 'librosa'",
]


@pytest.fixture(scope="module", name="table")
def _table() -> SignatureTable:
    return load_signature_table()


def _decide(table: SignatureTable, invocation: Invocation) -> tuple[Severity, Action, str]:
    verdict, phase = judge(Classifier(table), invocation, GOOD_START_S)
    decision = RestartPolicy().decide(invocation, verdict, Evidence(phase=phase))
    return verdict.severity, decision.action, verdict.root_cause or ""


def _served_then_ended(
    texts: list[str], *, exit_status: int = 1, served_s: float = 60
) -> Invocation:
    invocation = failed_invocation(
        texts, started_us=0, served_us=200_000_000, ended_us=int(200e6 + served_s * 1e6)
    )
    if exit_status == 0:
        invocation = dataclasses.replace(invocation, exit_status=0, result="success")
    return invocation


class TestTheClassifier:
    @pytest.mark.parametrize("exit_status", [1, 0])
    def test_a_prompt_in_the_request_log_is_never_the_cause(
        self, table: SignatureTable, exit_status: int
    ) -> None:
        severity, action, cause = _decide(
            table, _served_then_ended([*SERVING, PROMPT], exit_status=exit_status)
        )
        assert "Received request" not in cause and "flashinfer" not in cause
        assert severity is not Severity.FATAL
        assert action is not Action.HALT

    @pytest.mark.parametrize("exit_status", [1, 0])
    def test_a_request_handler_exception_is_context_never_a_fatal_cause(
        self, table: SignatureTable, exit_status: int
    ) -> None:
        severity, action, _ = _decide(
            table, _served_then_ended([*SERVING, *ASGI_ERROR], exit_status=exit_status)
        )
        assert severity is not Severity.FATAL
        assert action is not Action.HALT

    def test_a_crash_in_request_frames_served_without_a_serving_line(
        self, table: SignatureTable
    ) -> None:
        """Five minutes up with uvicorn at warning level (no serving line), then a lazy
        import fails inside a request handler: it was serving, so no halt at the 1st crash."""
        invocation = failed_invocation(
            ["vLLM API server version 0.33.0", *LAZY_IMPORT], ended_us=int(300e6)
        )
        _, action, _ = _decide(table, invocation)
        assert action is not Action.HALT

    def test_the_engines_own_error_still_decides(self, table: SignatureTable) -> None:
        """The same prompt beside the engine's real traceback: the real one is the cause."""
        real = [
            "Traceback (most recent call last):",
            f'  File "{SITE}/flashinfer/jit/env.py", line 40, in <module>',
            "    raise RuntimeError(msg)",
            CUBIN,
        ]
        invocation = failed_invocation(["vLLM API server version 0.33.0", PROMPT, *real])
        severity, action, cause = _decide(table, invocation)
        assert cause == CUBIN and severity is Severity.FATAL and action is Action.HALT


def entry(text: str) -> JournalEntry:
    return JournalEntry(cursor="c", realtime_us=1, message=text, unit=UNIT, invocation_id=INV)


class TestTheHangDetector:
    @pytest.mark.parametrize(
        "text",
        [
            PROMPT,
            "INFO 12-01 10:05:02 [logger.py:43] Received request x: prompt: 'EngineDeadError'",
            'INFO:     127.0.0.1:1 - "GET /EngineDeadError HTTP/1.1" 404 Not Found',
            "DEBUG 12-01 10:05:02 [core.py:1] Worker proc VllmWorker-0 died unexpectedly",
        ],
    )
    def test_a_request_or_info_line_is_no_death(self, text: str) -> None:
        detector = HangDetector({UNIT: 1.0}, clock=lambda: 0.0)
        detector.observe(entry(text))
        assert detector.due(100.0) == []

    @pytest.mark.parametrize(
        "text",
        [
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.",
            "(APIServer pid=12) ERROR 12-01 10:05:02 [core_client.py:564] Engine core proc "
            "EngineCore_0 died unexpectedly, shutting down client.",
            "[2025-01-01 10:00:00 TP0] Scheduler hit an exception: Traceback",
        ],
    )
    def test_the_engines_own_death_lines_still_count(self, text: str) -> None:
        detector = HangDetector({UNIT: 1.0}, clock=lambda: 0.0)
        detector.observe(entry(text))
        assert detector.due(100.0) == [UNIT]


@given(st.text(max_size=200))
def test_a_line_inside_a_request_log_never_starts_a_grace_period(prompt: str) -> None:
    """Whatever a client puts in its prompt, the request log line that holds it is no death."""
    detector = HangDetector({UNIT: 1.0}, clock=lambda: 0.0)
    detector.observe(
        entry(f"INFO 12-01 10:05:02 [logger.py:43] Received request x: prompt: {prompt!r}")
    )
    assert detector.due(100.0) == []


@pytest.mark.parametrize(
    ("argv", "port"),
    [
        (["/opt/venv/bin/vllm", "serve", "/models/x", "--port", "8123"], 8123),
        (["/opt/venv/bin/vllm", "serve", "/models/x", "--port=8124"], 8124),
        (["/opt/venv/bin/vllm", "serve", "/models/x"], 8000),
        (["/usr/bin/python3", "-m", "vllm.entrypoints.openai.api_server", "--model", "m"], 8000),
        (["/usr/bin/python3", "-m", "sglang.launch_server", "--model-path", "m"], 30000),
        (["/bin/sh", "-c", "exec /opt/venv/bin/vllm serve m --port 9001"], 9001),
        (["/usr/bin/python3", "/opt/fake-server.py"], None),
        (["/opt/venv/bin/vllm", "serve", "m", "--port", "99999"], None),
    ],
)
def test_the_serving_port_is_read_from_exec_start(argv: list[str], port: int | None) -> None:
    assert serving_port(argv) == port


@given(st.lists(st.text(max_size=30), max_size=8))
def test_no_exec_start_crashes_the_port_reader(argv: list[str]) -> None:
    found = serving_port(argv)
    assert found is None or 0 <= found <= 65535


class Systemd:
    """systemd's answers for the one unit: active, and the ExecStart= it was given."""

    def __init__(self, argv: list[str]) -> None:
        self.argv = argv

    async def unit_state(self, unit: str) -> UnitState:
        return UnitState(
            active_state="active",
            sub_state="running",
            n_restarts=0,
            result="success",
            invocation_id=INV,
            main_pid=1,
        )

    async def exec_start(self, unit: str) -> list[str]:
        return self.argv


@pytest.fixture(name="health_server")
def _health_server() -> Iterator[tuple[int, list[int]]]:
    """A loopback HTTP server whose /health answers the status at the end of the list."""
    statuses = [200]
    loop = asyncio.new_event_loop()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head = f"HTTP/1.1 {statuses[-1]} X\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        writer.write(head.encode())
        await writer.drain()
        writer.close()

    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    port = int(server.sockets[0].getsockname()[1])
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield port, statuses
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        server.close()
        loop.close()


def _config(root: Path, **unit: object) -> Config:
    base = demo_config(root)
    return dataclasses.replace(
        base,
        units=(UnitConfig(**{"name": UNIT, "hang_grace_s": 0.5, **unit}),),  # type: ignore[arg-type]
    )


class TestHangConfirmation:
    async def test_without_health_url_or_port_a_hang_is_never_confirmed(
        self, tmp_path: Path
    ) -> None:
        watcher = HangWatcher(
            _config(tmp_path), systemd=Systemd(["/usr/bin/python3", "/opt/fake-server.py"])
        )
        assert await watcher.confirmed(UNIT) is False

    @pytest.mark.parametrize(("status", "hung"), [(200, False), (503, True), (500, True)])
    async def test_the_port_from_exec_start_is_probed(
        self, tmp_path: Path, health_server: tuple[int, list[int]], status: int, hung: bool
    ) -> None:
        port, statuses = health_server
        statuses.append(status)
        argv = ["/opt/venv/bin/vllm", "serve", "m", "--port", str(port)]
        watcher = HangWatcher(_config(tmp_path), systemd=Systemd(argv))
        assert await watcher.confirmed(UNIT) is hung

    async def test_nothing_listening_on_a_derived_port_is_no_proof(self, tmp_path: Path) -> None:
        argv = ["/opt/venv/bin/vllm", "serve", "m", "--port", "1"]
        watcher = HangWatcher(_config(tmp_path), systemd=Systemd(argv))
        assert await watcher.confirmed(UNIT) is False
