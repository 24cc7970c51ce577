"""Whether a served unit's line says the server is up and answering requests, or which phase
of its start it is in."""

from __future__ import annotations

import re

from ..engines.profiles import Engines, follow, hints_of, patterns_of

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# The ASGI server's own lines, whichever engine it serves: uvicorn's start (vLLM, SGLang) and
# its access log of requests served. Each engine file adds its own ([[serving]]).
_ASGI_SERVING = (
    r"Application startup complete\.",
    r"Uvicorn running on",
    r'"(?:GET|POST) /(?:v1/|health|generate|metrics)\S* HTTP/[\d.]+" 200',
)
_ASGI_HINTS = ("startup complete.", "Uvicorn running on", "HTTP/1.1")
_SERVING: re.Pattern[str]
_SERVING_HINTS: tuple[str, ...]
_PHASES: tuple[tuple[re.Pattern[str], str], ...]
_PHASE_HINTS: tuple[str, ...]


def _use_engines(engines: Engines) -> None:
    """The serving lines of the ASGI server and of every engine file, and the engines' start
    phases (profiles.follow)."""
    global _SERVING, _SERVING_HINTS, _PHASES, _PHASE_HINTS
    patterns = (*_ASGI_SERVING, *patterns_of(engines.serving))
    _SERVING = re.compile("|".join(f"(?:{pattern})" for pattern in patterns))
    _SERVING_HINTS = tuple(dict.fromkeys((*_ASGI_HINTS, *hints_of(engines.serving))))
    _PHASES = tuple((re.compile(rule.pattern), rule.name) for rule in engines.phases)
    _PHASE_HINTS = hints_of(engines.phases)


follow(_use_engines)


def is_serving_line(text: str) -> bool:
    """True when a served unit's line says the server is up and answering requests."""
    # Every line of a start is asked until it is good: reject most without a regex.
    if not any(hint in text for hint in _SERVING_HINTS):
        return False
    return _SERVING.search(_ANSI.sub("", text).strip()) is not None


def start_phase(text: str) -> str | None:
    """The phase of its start a line says the engine is in (`[[phase]]`: weights, CUDA graphs,
    ...), or None for a line that says none."""
    if not any(hint in text for hint in _PHASE_HINTS):
        return None
    clean = _ANSI.sub("", text)
    return next((name for pattern, name in _PHASES if pattern.search(clean)), None)
