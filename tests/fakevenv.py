"""Real virtual environments holding hand-written distributions, for environment and preflight.

`python -m venv --without-pip` makes a real venv (seconds); a distribution is a
`<name>-<version>.dist-info` directory with METADATA, RECORD and INSTALLER, which is all
`importlib.metadata` reads. The venvs are made once per test session and shared by modules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_supervisor.commands.demo import Dist, make_venv

# Venv name -> its distributions.
LAYOUTS: Mapping[str, Sequence[Dist]] = {
    # Consistent: one flashinfer version; vllm's requirements hold, markers and extras included.
    "good": (
        ("flashinfer-python", "0.6.3", ()),
        ("flashinfer-cubin", "0.6.3", ()),
        ("flashinfer-jit-cache", "0.6.3+cu129", ()),
        (
            "vllm",
            "0.11.0",
            (
                "torch==2.9.0",
                "flashinfer-python==0.6.3",
                'pywin32>=300; sys_platform == "win32"',
                'tensorizer>=2.9; extra == "tensorizer"',
            ),
        ),
        ("torch", "2.9.0", ()),
    ),
    # flashinfer-python upgraded alone: the crash flashinfer raises at engine start.
    "upgraded": (
        ("flashinfer-python", "0.6.4", ()),
        ("flashinfer-cubin", "0.6.3", ()),
    ),
    # vllm pins a torch that is not the one installed.
    "unsatisfied": (
        ("vllm", "0.11.0", ("torch==2.9.0",)),
        ("torch", "2.8.0", ()),
    ),
}


@dataclass(frozen=True)
class Venvs:
    """The interpreters of the session's venvs, by layout name."""

    pythons: Mapping[str, Path]

    def __getitem__(self, name: str) -> Path:
        return self.pythons[name]


_CACHE: dict[int, Venvs] = {}


def session_venvs(factory: pytest.TempPathFactory) -> Venvs:
    """Every layout as a venv, made once per session however many modules ask."""
    key = id(factory)
    if key not in _CACHE:
        base = factory.mktemp("venvs")
        _CACHE[key] = Venvs({n: make_venv(base / n, d) for n, d in LAYOUTS.items()})
    return _CACHE[key]
