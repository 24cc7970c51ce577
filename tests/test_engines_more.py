"""llama.cpp's server, LMDeploy, Triton Inference Server and Ollama beside vLLM, SGLang and TGI
(issue 34).

Each engine file (config/engines/llamacpp.toml, lmdeploy.toml, tritonserver.toml, ollama.toml) is
checked
against lines from real logs posted in the projects' issues (their URLs in the engine files'
comments): which say the server serves, which prefix and level the lines have, which say its
engine died, and which are no such thing (llama.cpp's HTTP socket is up before its model loads;
LMDeploy's HINT comes before uvicorn binds). Their crash signatures' vectors are in
tests/data/signature_vectors.toml.
"""

from __future__ import annotations

import re

import pytest

from vllm_supervisor.classify.logline import parse_line
from vllm_supervisor.decide.hang import _DEATH, is_engine_death
from vllm_supervisor.engines.profiles import current
from vllm_supervisor.environment.serving import is_serving_line
from vllm_supervisor.model import LogLine

SERVING = [
    "main: server is listening on http://0.0.0.0:8080 - starting the main loop",
    "srv  update_slots: all slots are idle",
    "srv  log_server_r: done request: POST /v1/chat/completions 127.0.0.1 200",
    "[2026-03-13 14:54:59 DP0] Avg thr (in/out): 1445.8 / 68.8 tokens/s, Server (succeeded/"
    "failed/routed/waiting): 102 / 100 / 0 / 0, Engine (running/waiting): 0 / 0, KV cache: 17.5%,",
    "I1025 08:16:46.669373 85102 grpc_server.cc:2451] Started GRPCInferenceService at 0.0.0.0:8001",
    "I1025 08:16:46.669634 85102 http_server.cc:3558] Started HTTPService at 0.0.0.0:8000",
    'I0803 18:43:44.778681 1525575 http_server.cc:4961] "Started HTTPService at 0.0.0.0:8000"',
    # Ollama's listener (models load per request, later), with slog's prefix and before it.
    'time=2024-09-11T16:56:38.833-07:00 level=INFO source=routes.go:1172 msg="Listening on '
    '127.0.0.1:11434 (version 0.3.10)"',
    "2023/11/15 10:33:48 routes.go:777: Listening on 127.0.0.1:11434 (version 0.1.10)",
    "2023/10/06 13:38:58 routes.go:572: Listening on 127.0.0.1:11434",
]
NOT_SERVING = [
    # llama.cpp's HTTP socket, up before the model loads.
    "main: HTTP server is listening, hostname: 127.0.0.1, port: 8080, http threads: 11",
    "main: loading model",
    # LMDeploy's hint, printed before uvicorn binds its port.
    "HINT:    Please open http://0.0.0.0:23333 in a browser for detailed api usage!!!",
    "I1106 12:36:07.336926 3487 model_lifecycle.cc:461] loading: tensorrt_llm:1",
]
LEVELS = [
    ("0.40.048.527 E srv    operator(): http client error: Failed to read connection", "ERROR"),
    ("2024-10-21 10:09:43,821 - lmdeploy - INFO - model_weight_loader.py:152 - rank[2] loading "
     'weights - "model-00031-of-00038.safetensors"', "INFO"),
    ("2024-08-05 05:40:52,191 - lmdeploy - WARNING - model_source: hf_model", "WARNING"),
    ("[TM][WARN][0912.11:43:21.506350][turbomind.cc:123] `max_context_token_num` is not set, "
     "default to 18432.", "WARNING"),
    ("[TensorRT-LLM][WARNING] kv_cache_free_gpu_mem_fraction is not specified, will use default "
     "value of 0.85 or max_tokens_in_paged_kv_cache", "WARNING"),
    ("E0120 08:28:09.425599 2049 model_lifecycle.cc:654] \"failed to load 'tensorrt_llm' version "
     "1: Invalid argument: unable to find backend library for backend 'tensorrtllm'\"", "ERROR"),
    ('time=2024-11-04T10:00:00.000Z level=ERROR source=sched.go:455 msg="error loading llama '
     'server" error="llama runner process has terminated: exit status 2"', "ERROR"),
    ('time=2024-05-12T06:47:18.590-06:00 level=WARN source=gpu.go:60 msg="no compatible GPUs '
     'were discovered"', "WARNING"),
]  # fmt: skip
DEATHS = [
    "2024-10-21 10:42:00,218 - lmdeploy - ERROR - model_agent.py:489 - Rank[2] failed.",
    "2025-04-21 10:43:58,013 - lmdeploy - ERROR - engine.py:781 - Task <EngineMainLoop> failed",
    "2026-02-09 13:59:17,124 - lmdeploy - ERROR - base.py:56 - <transformers> check failed!",
]


def test_the_engines_in_force_include_the_new_ones() -> None:
    assert {"llamacpp", "lmdeploy", "tritonserver", "ollama"} <= set(current().ids)


@pytest.mark.parametrize("line", SERVING)
def test_a_serving_line(line: str) -> None:
    assert is_serving_line(line)


@pytest.mark.parametrize("line", NOT_SERVING)
def test_not_yet_serving(line: str) -> None:
    assert not is_serving_line(line)


@pytest.mark.parametrize(("line", "level"), LEVELS)
def test_the_prefix_and_its_level(line: str, level: str) -> None:
    parsed = parse_line(LogLine(text=line))
    assert parsed.level == level, parsed
    assert not parsed.text.startswith(("- lmdeploy", "[TM]", "[TensorRT-LLM]", "0.40.", "time=")), (
        parsed
    )


@pytest.mark.parametrize("line", DEATHS)
def test_the_engines_death(line: str) -> None:
    assert is_engine_death(line, _DEATH)


def test_a_go_panic_is_the_cause() -> None:
    """Ollama's server dies in a Go panic: its line is the cause, not the goroutines' stacks."""
    from vllm_supervisor.classify.classifier import Classifier
    from vllm_supervisor.classify.signatures import load_signature_table

    lines = [
        'time=2024-09-11T16:56:38.833-07:00 level=INFO source=routes.go:1172 msg="Listening on '
        '127.0.0.1:11434 (version 0.3.10)"',
        "panic: assignment to entry in nil map",
        "",
        "goroutine 52 [running]:",
        "github.com/ollama/ollama/server.(*Server).GenerateHandler(0xc000, 0xc0001)",
        "\t/go/src/github.com/ollama/ollama/server/routes.go:123 +0x4f",
    ]
    verdict = Classifier(load_signature_table()).classify([LogLine(text=t) for t in lines])
    assert verdict.root_cause == lines[1]


def test_gins_access_log_is_a_clients() -> None:
    """gin's access line quotes the path a client asked for: a request's line, never a cause."""
    line = '[GIN] 2024/11/04 - 10:00:05 | 500 |  1.2s |  127.0.0.1 | POST "/api/generate/fatal"'
    assert any(re.search(pattern, line) for pattern in current().request_lines)
