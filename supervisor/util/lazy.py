"""A stage package's public names, each imported from its module when first used (PEP 562).

The commands import a stage's names from its package (`from ..actions import ask`); importing
every module of the package up front would make each command, `gate` on every start of a served
unit among them, pay for all of them.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, modules: Mapping[str, str]) -> Callable[[str], Any]:
    """The package's `__getattr__`: `modules` maps each public name to its module's name."""

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)  # found once, then a plain attribute
        return value

    return __getattr__
