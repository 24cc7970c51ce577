"""llama.cpp's server, LMDeploy and Triton Inference Server beside vLLM, SGLang and TGI (issue 34).

Each engine file (config/engines/llamacpp.toml, lmdeploy.toml, tritonserver.toml) is checked
against lines from real logs posted in the projects' issues (their URLs in the engine files'
comments): which say the server serves, which prefix and level the lines have, which say its
engine died, and which are no such thing (llama.cpp's HTTP socket is up before its model loads;
LMDeploy's HINT comes before uvicorn binds). Their crash signatures' vectors are in
tests/data/signature_vectors.toml.
"""

from __future__ import annotations

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
]  # fmt: skip
DEATHS = [
    "2024-10-21 10:42:00,218 - lmdeploy - ERROR - model_agent.py:489 - Rank[2] failed.",
    "2025-04-21 10:43:58,013 - lmdeploy - ERROR - engine.py:781 - Task <EngineMainLoop> failed",
    "2026-02-09 13:59:17,124 - lmdeploy - ERROR - base.py:56 - <transformers> check failed!",
]


def test_the_engines_in_force_include_the_new_three() -> None:
    assert {"llamacpp", "lmdeploy", "tritonserver"} <= set(current().ids)


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
    assert not parsed.text.startswith(("- lmdeploy", "[TM]", "[TensorRT-LLM]", "0.40.")), parsed


@pytest.mark.parametrize("line", DEATHS)
def test_the_engines_death(line: str) -> None:
    assert is_engine_death(line, _DEATH)
