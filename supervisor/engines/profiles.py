"""The engine files in force: loaded, merged, and handed to the stages that read them.

The stages match engine knowledge on every line (log prefixes, serving and death lines), so
each keeps it compiled in module constants, as it did when they were written in code. They
`follow` the engines in force: called at once and again whenever `install` puts a new set in
force (at start, and on SIGHUP with the signature table; a set that did not load is never
installed, so the old one stays). Without an explicit install, the first `current` loads the
shipped files (or those of `$VLLM_SUPERVISOR_ENGINES`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..util.files import data_path
from .schema import (
    EngineProfile,
    LineRule,
    PhaseRule,
    PrefixRule,
    engine_error,
    read_engine_file,
)

ENV_ENGINE_DIR = "VLLM_SUPERVISOR_ENGINES"
Listener = Callable[["Engines"], None]


def _unique(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(values))


@dataclass(frozen=True, slots=True)
class Engines:
    """Every engine's knowledge together, in file order, each list without repeats."""

    profiles: tuple[EngineProfile, ...]

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(p.id for p in self.profiles)

    @property
    def packages(self) -> tuple[str, ...]:
        return _unique(n for p in self.profiles for n in p.packages)

    @property
    def default_ports(self) -> tuple[tuple[tuple[str, ...], int], ...]:
        """(argv words, port) for every command of an engine with a default port."""
        return tuple(
            (command, p.default_port)
            for p in self.profiles
            if p.default_port is not None
            for command in p.commands
        )

    @property
    def port_options(self) -> tuple[str, ...]:
        return _unique(o for p in self.profiles for o in p.port_options)

    @property
    def server_paths(self) -> tuple[str, ...]:
        return _unique(s for p in self.profiles for s in p.server_paths)

    @property
    def model_paths(self) -> tuple[str, ...]:
        return _unique(s for p in self.profiles for s in p.model_paths)

    @property
    def startup_frames(self) -> tuple[str, ...]:
        return _unique(s for p in self.profiles for s in p.startup_frames)

    @property
    def serving_frames(self) -> tuple[str, ...]:
        return _unique(s for p in self.profiles for s in p.serving_frames)

    @property
    def request_frames(self) -> tuple[str, ...]:
        return _unique(s for p in self.profiles for s in p.request_frames)

    @property
    def request_lines(self) -> tuple[str, ...]:
        return _unique(s for p in self.profiles for s in p.request_lines)

    @property
    def port_lines(self) -> tuple[str, ...]:
        return _unique(s for p in self.profiles for s in p.port_lines)

    @property
    def self_kill(self) -> tuple[str, ...]:
        return _unique(s for p in self.profiles for s in p.self_kill)

    @property
    def serving(self) -> tuple[LineRule, ...]:
        return tuple(rule for p in self.profiles for rule in p.serving)

    @property
    def death(self) -> tuple[LineRule, ...]:
        return tuple(rule for p in self.profiles for rule in p.death)

    @property
    def phases(self) -> tuple[PhaseRule, ...]:
        return tuple(rule for p in self.profiles for rule in p.phases)

    @property
    def prefixes(self) -> tuple[PrefixRule, ...]:
        return tuple(rule for p in self.profiles for rule in p.prefixes)


def patterns_of(rules: Sequence[LineRule]) -> tuple[str, ...]:
    """The rules' patterns, each once."""
    return _unique(rule.pattern for rule in rules)


def hints_of(rules: Sequence[LineRule]) -> tuple[str, ...]:
    """The rules' hints, each once."""
    return _unique(hint for rule in rules for hint in rule.hints)


def default_engine_dir() -> Path:
    """`$VLLM_SUPERVISOR_ENGINES`, else the shipped engine files."""
    env = os.environ.get(ENV_ENGINE_DIR)
    return Path(env) if env else data_path("engines")


def load_engines(directory: Path | None = None) -> Engines:
    """Every `*.toml` of `directory` (default_engine_dir), sorted; raise EngineFileError."""
    directory = default_engine_dir() if directory is None else directory
    if not directory.is_dir():
        raise engine_error(f"{directory}: no such engine directory")
    return Engines(tuple(read_engine_file(path) for path in sorted(directory.glob("*.toml"))))


_lock = threading.RLock()
_current: Engines | None = None
_listeners: list[Listener] = []


def current() -> Engines:
    """The engines in force (the default directory's, loaded at the first call)."""
    engines = _current
    if engines is None:
        engines = load_engines()
        install(engines)
    return engines


def install(engines: Engines) -> None:
    """Put `engines` in force: every follower rebuilds what it compiled from them."""
    global _current
    with _lock:
        _current = engines
        for listener in list(_listeners):
            listener(engines)


def follow(listener: Listener) -> None:
    """Call `listener` with the engines in force now and whenever others are installed."""
    with _lock:
        engines = current()
        _listeners.append(listener)
        listener(engines)
