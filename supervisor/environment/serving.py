"""Whether a served unit's line says the server is up and answering requests."""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_SERVING = re.compile(
    r"Application startup complete\."  # uvicorn (vLLM, SGLang)
    r"|Uvicorn running on"
    r"|The server is fired up and ready to roll!"  # SGLang
    r"|(?:^|:\s)(?:Connected|Ready)$"  # TGI's router, at the end of its tracing line
    # Requests being served: uvicorn's access log, vLLM's and SGLang's throughput lines.
    r'|"(?:GET|POST) /(?:v1/|health|generate|metrics)\S* HTTP/[\d.]+" 200'
    r"|Avg prompt throughput: |Avg generation throughput: "
    r"|(?:Prefill|Decode) batch[.,] #"
)
_SERVING_HINTS = (
    "startup complete.",
    "Uvicorn running on",
    "fired up",
    "Connected",
    "Ready",
    "HTTP/1.1",
    "throughput: ",
    " batch",
)


def is_serving_line(text: str) -> bool:
    """True when a served unit's line says the server is up and answering requests."""
    # Every line of a start is asked until it is good: reject most without a regex.
    if not any(hint in text for hint in _SERVING_HINTS):
        return False
    return _SERVING.search(_ANSI.sub("", text).strip()) is not None
