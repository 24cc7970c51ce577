"""Validate one engine file into an `EngineProfile`, with messages that name the file and key.

An engine file, `config/engines/<engine>.toml`, says what the stages know of one inference
server apart from its crash signatures (`config/signatures/<engine>.toml`, the same stem): the
prefixes its logger writes, the lines that say it serves or that its engine died, its frames'
paths and function names, its packages and the port it listens on by default. Every error is
one line naming the file and the key, e.g. `config/engines/vllm.toml: death[2].pattern: invalid
regex: missing ), unterminated subpattern at position 4`.

The regexes are Python's `re`, compiled as the modules that match them always have: a log
prefix is matched anchored at one position of every line (TGI's needs a lookahead, which RE2
lacks), the other lines only once a literal hint was found in them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ..errors import EngineFileError
from ..util.files import read_toml

_ENGINE_ID = re.compile(r"[a-z][a-z0-9_]*\Z")
_PACKAGE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?\Z")
_KEYS: Mapping[str, type] = MappingProxyType(
    {
        "name": str,
        "packages": list,
        "default_port": int,
        "commands": list,
        "port_options": list,
        "server_paths": list,
        "model_paths": list,
        "startup_frames": list,
        "serving_frames": list,
        "request_frames": list,
        "request_lines": list,
        "port_lines": list,
        "self_kill": list,
        "serving": list,
        "death": list,
        "phase": list,
        "prefix": list,
    }
)
_REQUIRED = ("name",)
_RULE_KEYS = ("pattern", "hints")
_PHASE_KEYS = ("name", *_RULE_KEYS)
# A start's phases, named alike across engines: a metric label's values (bounded).
PHASES = (
    "download", "distributed_init", "weights", "compile", "kv_cache", "cuda_graphs", "warmup",
)  # fmt: skip
_PREFIX_KEYS = ("position", "starts", "pattern", "levels")
# Where a prefix stands and the character class its first character is in: logline.py tries a
# line's prefixes by that class, so a line tries only the few that can match.
STARTS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "outer": ("digit", "letter", "bracket", "paren"),  # journal, container, process tags
        # A logger's own; level: a level word's initial (D I W E C F), dash `- `, pipe `| `.
        "inner": ("level", "bracket", "paren", "dash", "pipe"),
    }
)
PREFIX_GROUPS = ("level", "process", "pid")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_NAMED_GROUP = re.compile(r"\(\?P<(\w+)>")
_REGEX_ERRORS = (re.error, OverflowError, RecursionError, ValueError)


@dataclass(frozen=True, slots=True, kw_only=True)
class LineRule:
    """A line that means something (the server serves, its engine died), with the literals
    of which every line the pattern matches holds one: they reject other lines without a regex."""

    pattern: str
    hints: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseRule(LineRule):
    """A line that says which phase of its start the engine is in (weights, CUDA graphs, ...):
    the last one read names where a start that does not serve is stuck."""

    name: str  # one of PHASES


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefixRule:
    """A prefix the engine's logger writes before its text, as logline.py strips it."""

    kind: str  # the outer group's name, unique across engines: `<engine>_<n>`
    position: str  # outer | inner
    starts: str  # the class of its first character (STARTS)
    pattern: str  # as written, its groups named level, process, pid
    levels: Mapping[str, str]  # what the level group captures -> a LEVELS name

    @property
    def grouped(self) -> str:
        """The pattern in a group named `kind`, its own groups renamed `<kind>_<name>`."""
        renamed = _NAMED_GROUP.sub(lambda m: f"(?P<{self.kind}_{m.group(1)}>", self.pattern)
        return f"(?P<{self.kind}>{renamed})"

    def group(self, name: str) -> str | None:
        """The renamed group for level, process or pid, when the pattern has one."""
        return f"{self.kind}_{name}" if f"(?P<{name}>" in self.pattern else None


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineProfile:
    """One validated engine file."""

    id: str  # the file's stem, also its signatures' domain
    name: str
    packages: tuple[str, ...] = ()
    default_port: int | None = None
    commands: tuple[tuple[str, ...], ...] = ()  # argv words (basenames) that start the server
    port_options: tuple[str, ...] = ()  # options naming the port besides --port
    server_paths: tuple[str, ...] = ()  # a frame's path in the server's own code
    model_paths: tuple[str, ...] = ()  # ... in its model code
    startup_frames: tuple[str, ...] = ()  # function names (regexes) of starting up
    serving_frames: tuple[str, ...] = ()  # ... of serving requests
    # ... of one request's handling (its API handlers): an error there is that request's
    request_frames: tuple[str, ...] = ()
    request_lines: tuple[str, ...] = ()  # a request logged: it quotes what a client sent
    port_lines: tuple[str, ...] = ()  # a bind error's port, in the regex's one group
    # The engine saying it kills its own process tree (itself included): a SIGKILL of its main
    # process after it is its own end, not a kill from outside.
    self_kill: tuple[str, ...] = ()
    serving: tuple[LineRule, ...] = ()
    death: tuple[LineRule, ...] = ()
    phases: tuple[PhaseRule, ...] = ()
    prefixes: tuple[PrefixRule, ...] = ()


class _Where:
    """Builds the one-line errors of one file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def error(self, key: str, message: str) -> EngineFileError:
        return engine_error(f"{self.path}: {key}: {message}")


def engine_error(message: str) -> EngineFileError:
    """The error, on one line whatever a key or a library's message held."""
    return EngineFileError(message.replace("\r", "\\r").replace("\n", "\\n"))


def _type_name(value: Any) -> str:
    return type(value).__name__


def _compile(pattern: str, key: str, where: _Where, template: str = "{}") -> re.Pattern[str]:
    try:
        return re.compile(template.format(pattern))
    except _REGEX_ERRORS as exc:
        raise where.error(key, f"invalid regex: {exc}") from exc


def _strings(raw: Mapping[str, Any], key: str, where: _Where) -> tuple[str, ...]:
    """A list of non-empty strings under `key` (empty when absent)."""
    values = raw.get(key, [])
    for index, value in enumerate(values):
        if not isinstance(value, str):
            raise where.error(f"{key}[{index}]", f"must be a str, got {_type_name(value)}")
        if not value:
            raise where.error(f"{key}[{index}]", "must not be empty")
    return tuple(values)


def _regexes(
    raw: Mapping[str, Any], key: str, where: _Where, template: str = "{}"
) -> tuple[str, ...]:
    """A list of valid regexes under `key`."""
    values = _strings(raw, key, where)
    for index, pattern in enumerate(values):
        _compile(pattern, f"{key}[{index}]", where, template)
    return values


def _packages(raw: Mapping[str, Any], where: _Where) -> tuple[str, ...]:
    values = _strings(raw, "packages", where)
    for index, name in enumerate(values):
        if not _PACKAGE.match(name):
            raise where.error(f"packages[{index}]", f"not a package name: {name!r}")
    return values


def _commands(raw: Mapping[str, Any], where: _Where) -> tuple[tuple[str, ...], ...]:
    """Runs of argv words, each compared with the basenames of a unit's ExecStart= words."""
    commands: list[tuple[str, ...]] = []
    for index, words in enumerate(raw.get("commands", [])):
        key = f"commands[{index}]"
        if not isinstance(words, list) or not words:
            raise where.error(key, 'must be a non-empty list of words, e.g. ["vllm", "serve"]')
        for word in words:
            if not isinstance(word, str) or not word or "/" in word or word != word.strip():
                raise where.error(key, f"a word must be a file's name or an argument: {word!r}")
        commands.append(tuple(words))
    return tuple(commands)


def _port(
    raw: Mapping[str, Any], commands: tuple[tuple[str, ...], ...], where: _Where
) -> int | None:
    port = raw.get("default_port")
    if port is None:
        if commands:
            raise where.error("commands", "name default_port too: commands say when it applies")
        return None
    if not 0 < port < 65536:
        raise where.error("default_port", f"must be a TCP port (1-65535), got {port}")
    if not commands:
        raise where.error("default_port", "needs commands: the argv words that start the server")
    return int(port)


def _port_options(raw: Mapping[str, Any], where: _Where) -> tuple[str, ...]:
    values = _strings(raw, "port_options", where)
    for index, option in enumerate(values):
        if not re.fullmatch(r"--?[A-Za-z0-9][\w-]*", option):
            raise where.error(f"port_options[{index}]", f"not a command-line option: {option!r}")
    return values


def _port_lines(raw: Mapping[str, Any], where: _Where) -> tuple[str, ...]:
    values = _regexes(raw, "port_lines", where)
    for index, pattern in enumerate(values):
        if re.compile(pattern).groups != 1:
            raise where.error(f"port_lines[{index}]", "must hold exactly one group: the port")
    return values


def _table(item: Any, key: str, allowed: tuple[str, ...], where: _Where) -> Mapping[str, Any]:
    if not isinstance(item, dict):
        raise where.error(key, f"must be a table, got {_type_name(item)}")
    for name in item:
        if name not in allowed:
            raise where.error(f"{key}.{name}", f"unknown key (allowed: {', '.join(allowed)})")
    return item


def _rules(raw: Mapping[str, Any], key: str, where: _Where) -> tuple[LineRule, ...]:
    """`[[serving]]` or `[[death]]`: each a pattern and the hints its lines hold."""
    return tuple(
        _rule(_table(item, f"{key}[{index}]", _RULE_KEYS, where), f"{key}[{index}]", where)
        for index, item in enumerate(raw.get(key, []))
    )


def _rule(table: Mapping[str, Any], at: str, where: _Where) -> LineRule:
    pattern = table.get("pattern")
    if not isinstance(pattern, str) or not pattern:
        raise where.error(f"{at}.pattern", "missing (required): a regex")
    _compile(pattern, f"{at}.pattern", where)
    hints = table.get("hints")
    if not isinstance(hints, list) or not hints:
        raise where.error(f"{at}.hints", "missing (required): literals its lines hold")
    return LineRule(pattern=pattern, hints=_strings(table, "hints", _Nested(where, at)))


def _phases(raw: Mapping[str, Any], where: _Where) -> tuple[PhaseRule, ...]:
    """`[[phase]]`: a name of PHASES, and a rule as `[[serving]]`'s."""
    phases: list[PhaseRule] = []
    for index, item in enumerate(raw.get("phase", [])):
        at = f"phase[{index}]"
        table = _table(item, at, _PHASE_KEYS, where)
        name = table.get("name")
        if name not in PHASES:
            raise where.error(f"{at}.name", f"expected one of {', '.join(PHASES)} (got {name!r})")
        rule = _rule(table, at, where)
        phases.append(PhaseRule(name=name, pattern=rule.pattern, hints=rule.hints))
    return tuple(phases)


class _Nested(_Where):
    """Errors for keys inside an array's table: `death[1].hints[0]: ...`."""

    def __init__(self, outer: _Where, at: str) -> None:
        super().__init__(outer.path)
        self.at = at

    def error(self, key: str, message: str) -> EngineFileError:
        return super().error(f"{self.at}.{key}", message)


def _prefixes(raw: Mapping[str, Any], engine_id: str, where: _Where) -> tuple[PrefixRule, ...]:
    rules: list[PrefixRule] = []
    for index, item in enumerate(raw.get("prefix", [])):
        at = f"prefix[{index}]"
        table = _table(item, at, _PREFIX_KEYS, where)
        position = table.get("position")
        if not isinstance(position, str) or position not in STARTS:
            raise where.error(f"{at}.position", f"must be one of {', '.join(STARTS)}")
        starts = table.get("starts")
        if starts not in STARTS[position]:
            allowed = ", ".join(STARTS[position])
            raise where.error(f"{at}.starts", f"an {position} prefix starts with one of {allowed}")
        pattern = table.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise where.error(f"{at}.pattern", "missing (required): a regex")
        rule = PrefixRule(
            kind=f"{engine_id}_{index}",
            position=position,
            starts=starts,
            pattern=pattern,
            levels=_levels(table, at, where),
        )
        _check_prefix(rule, at, where)
        if "levels" in table and rule.group("level") is None:
            raise where.error(f"{at}.levels", "the pattern has no (?P<level>...) group")
        rules.append(rule)
    return tuple(rules)


def _levels(table: Mapping[str, Any], at: str, where: _Where) -> Mapping[str, str]:
    """The level group's words, each mapped to a LEVELS name (those map to themselves)."""
    levels = table.get("levels", {})
    if not isinstance(levels, dict):
        raise where.error(f"{at}.levels", f"must be a table, got {_type_name(levels)}")
    for word, level in levels.items():
        if level not in LEVELS:
            raise where.error(f"{at}.levels.{word}", f"must be one of {', '.join(LEVELS)}")
    return MappingProxyType({**{name: name for name in LEVELS}, **levels})


def _check_prefix(rule: PrefixRule, at: str, where: _Where) -> None:
    """The pattern compiles in its group and names no group logline.py would not read."""
    for name in re.findall(r"\(\?P<(\w+)>", rule.pattern):
        if name not in PREFIX_GROUPS:
            allowed = ", ".join(PREFIX_GROUPS)
            raise where.error(f"{at}.pattern", f"group {name!r} is read by nothing ({allowed})")
    _compile(rule.pattern, f"{at}.pattern", where)  # its own errors' positions are the file's
    compiled = _compile(rule.grouped, f"{at}.pattern", where)
    expected = {rule.kind} | {f"{rule.kind}_{n}" for n in PREFIX_GROUPS if rule.group(n)}
    if set(compiled.groupindex) != expected:
        raise where.error(f"{at}.pattern", "write a named group as (?P<level>...), once each")


def _frames(raw: Mapping[str, Any], key: str, where: _Where) -> tuple[str, ...]:
    """Function names, each a regex matched as a whole name in `File "...", line N, in NAME`."""
    return _regexes(raw, key, where, template=r"\bin (?:{})\b")


def _check_keys(raw: Mapping[str, Any], where: _Where) -> None:
    for key, value in raw.items():
        if key not in _KEYS:
            raise where.error(key, f"unknown key (allowed: {', '.join(sorted(_KEYS))})")
        expected = _KEYS[key]
        # bool is an int subclass; `default_port = true` is a mistake, not 1.
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise where.error(key, f"must be a {expected.__name__}, got {_type_name(value)}")
    for key in _REQUIRED:
        if key not in raw:
            raise where.error(key, "missing (required)")


def parse_engine(raw: Mapping[str, Any], path: Path) -> EngineProfile:
    """Validate the parsed TOML of the engine file at `path`."""
    where = _Where(path)
    if not _ENGINE_ID.match(path.stem):
        raise engine_error(f"{path}: the file's name must be the engine's id: snake_case.toml")
    _check_keys(raw, where)
    commands = _commands(raw, where)
    return EngineProfile(
        id=path.stem,
        name=raw["name"],
        packages=_packages(raw, where),
        default_port=_port(raw, commands, where),
        commands=commands,
        port_options=_port_options(raw, where),
        server_paths=_strings(raw, "server_paths", where),
        model_paths=_strings(raw, "model_paths", where),
        startup_frames=_frames(raw, "startup_frames", where),
        serving_frames=_frames(raw, "serving_frames", where),
        request_frames=_frames(raw, "request_frames", where),
        request_lines=_regexes(raw, "request_lines", where),
        port_lines=_port_lines(raw, where),
        self_kill=_regexes(raw, "self_kill", where),
        serving=_rules(raw, "serving", where),
        death=_rules(raw, "death", where),
        phases=_phases(raw, where),
        prefixes=_prefixes(raw, path.stem, where),
    )


def read_engine_file(path: Path) -> EngineProfile:
    """Read and validate one engine file; raise EngineFileError (one line) on any fault."""
    return parse_engine(read_toml(path, engine_error), path)
