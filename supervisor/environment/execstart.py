"""The Python interpreter a unit's ExecStart= runs, through its wrappers and shebangs."""

from __future__ import annotations

import re
import shlex
import shutil
from collections.abc import Sequence
from pathlib import Path

from ..engines.profiles import Engines, follow

# The search path systemd uses for a bare ExecStart= name, and the PATH it gives a service
# unless the unit sets Environment=PATH (systemd.exec(5), "Environment variables").
SYSTEMD_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"

_PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?t?)?$")
_SHELLS = frozenset({"sh", "bash", "dash"})
# Wrappers that run the next command: the program is the first later argument that is a path
# or a python (their own options and values, such as `taskset -c 0-7`, are skipped that way).
_WRAPPERS = frozenset(
    {"exec", "nice", "ionice", "taskset", "numactl", "stdbuf", "chrt", "nohup", "setsid", "time"}
)
_RUNNERS = _WRAPPERS | _SHELLS | {"env"}
# pip writes this two-line shebang when the interpreter path is too long or has spaces.
_SH_EXEC_TRAMPOLINE = re.compile(r"^'''exec' (.+?) \"\$0\" \"\$@\"")


def interpreter_from_exec_start(
    argv: Sequence[str], *, search_path: str = SYSTEMD_DEFAULT_PATH
) -> Path | None:
    """The Python interpreter a unit's ExecStart= runs, or None when it runs no Python.

    Understands `python -m ...`, console scripts such as `/opt/venv/bin/vllm` (read through their
    shebang), `env` and shell wrappers, and systemd's ExecStart prefixes (`-`, `@`, `+`, ...).
    A binary such as TGI's `text-generation-launcher` gives None. Symlinks are not resolved:
    a venv's `bin/python` must be run by that path to see the venv.
    """
    command = _command(list(argv))
    if not command:
        return None
    program = command[0]
    if _PYTHON_NAME.match(Path(program).name):
        return _locate(program, search_path)
    path = _locate(program, search_path)
    return None if path is None else _shebang_interpreter(path, search_path)


def _command(argv: list[str]) -> list[str]:
    """The command line an ExecStart= line finally runs, after its prefix and wrappers (empty
    when a wrapper runs nothing)."""
    argv = _strip_systemd_prefix(argv)
    while argv:
        name = Path(argv[0]).name
        if name == "env":
            argv = _after_env(argv[1:])
        elif name in _SHELLS and "-c" in argv[1:-1]:
            argv = shlex.split(argv[argv.index("-c", 1) + 1])
        elif name in _WRAPPERS:
            argv = _after_wrapper(argv[1:])
        else:
            return argv
    return []


def _strip_systemd_prefix(argv: list[str]) -> list[str]:
    if not argv:
        return argv
    head = argv[0].lstrip("@-:+!|")
    # With "@", the second word is the argv[0] the program sees, not an argument.
    rest = argv[2:] if "@" in argv[0][: len(argv[0]) - len(head)] else argv[1:]
    return [head, *rest]


def _after_env(args: list[str]) -> list[str]:
    """The command `env [OPTIONS] [NAME=VALUE]... COMMAND` runs."""
    index = 0
    while index < len(args):
        arg = args[index]
        if arg in ("-S", "--split-string") and index + 1 < len(args):
            return shlex.split(args[index + 1]) + args[index + 2 :]
        if arg.startswith("-S") and len(arg) > 2:
            return shlex.split(arg[2:]) + args[index + 1 :]
        if arg == "--":
            return args[index + 1 :]
        if arg in ("-u", "--unset", "-C", "--chdir"):
            index += 2
            continue
        if not arg.startswith("-") and "=" not in arg:
            return args[index:]
        index += 1
    return []


def _after_wrapper(args: list[str]) -> list[str]:
    for index, arg in enumerate(args):
        if arg.startswith(("/", "./")) or _PYTHON_NAME.match(arg) or arg in _RUNNERS:
            return args[index:]
    return []


def _locate(program: str, search_path: str) -> Path | None:
    """An absolute or relative path as given; a bare name through `search_path`."""
    if "/" in program:
        return Path(program)
    found = shutil.which(program, path=search_path)
    return None if found is None else Path(found)


def shebang_words(line: str) -> list[str]:
    """The words of a script's `#!` line, its interpreter first; empty when it has none."""
    return line[2:].split() if line.startswith("#!") else []


def _shebang_interpreter(script: Path, search_path: str) -> Path | None:
    """The python a script's `#!` line names (directly, through env, or pip's sh trampoline)."""
    try:
        with script.open("rb") as handle:
            lines = handle.read(4096).decode(errors="replace").splitlines()
    except OSError:
        return None
    words = shebang_words(lines[0]) if lines else []
    if not words:
        return None
    name = Path(words[0]).name
    if name == "env":
        program = next(iter(_after_env(words[1:])), None)
    elif name in _SHELLS and len(lines) > 1 and (match := _SH_EXEC_TRAMPOLINE.match(lines[1])):
        program = shlex.split(match.group(1))[0]
    else:
        program = words[0]
    if program is None or not _PYTHON_NAME.match(Path(program).name):
        return None
    return _locate(program, search_path)


# The port each engine's server listens on when its command line names none: the engine files'
# default_port, for the argv words of their commands. The option that names it: `--port`, or
# one an engine file adds (port_options: LMDeploy's `--server-port`).
_DEFAULT_PORTS: tuple[tuple[tuple[str, ...], int], ...]
_PORT_OPTIONS: frozenset[str]


def _use_engines(engines: Engines) -> None:
    """The default ports and port options of the engine files in force (profiles.follow)."""
    global _DEFAULT_PORTS, _PORT_OPTIONS
    _DEFAULT_PORTS = engines.default_ports
    _PORT_OPTIONS = frozenset({"--port", *engines.port_options})


follow(_use_engines)


def serving_port(argv: Sequence[str]) -> int | None:
    """The TCP port a server's ExecStart= makes it listen on: its `--port` (or an engine file's
    port option), else the engine's
    default (an engine file's default_port: vLLM 8000, SGLang 30000, TGI 3000); None when
    neither is known."""
    try:
        words = _command(list(argv))
    except ValueError:  # an unbalanced quote in a shell's script or `env -S`: as they are
        words = list(argv)
    for index, word in enumerate(words):
        value = None
        option, equals, given = word.partition("=")
        if option in _PORT_OPTIONS:
            value = given if equals else (words[index + 1] if index + 1 < len(words) else None)
        if value is not None:
            return (
                int(value) if value.isascii() and value.isdigit() and int(value) < 65536 else None
            )
    names = [Path(word).name for word in words]
    for marks, port in _DEFAULT_PORTS:
        if _contains_run(names, marks):
            return port
    return None


def _contains_run(words: list[str], run: tuple[str, ...]) -> bool:
    return any(tuple(words[i : i + len(run)]) == run for i in range(len(words)))
