"""Environment drift: what a served unit's interpreter had installed at each start.

A unit that ran for weeks and now crashes at every start usually changed underneath: someone ran
`pip install -U` in its virtual environment, or the NVIDIA driver was upgraded. The daemon takes an
`EnvSnapshot` when an invocation starts, marks it good once the server came up, and on a crash
names what changed since the last good start (`flashinfer-python 0.6.3 → 0.6.4`).

The served unit's interpreter is another virtual environment, so its distributions are read by
running that interpreter (`python -I -c <probe>`): the probe uses only the standard library, so it
works in any venv, and it prints JSON that is parsed here. `preflight` reuses the same probe.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sqlite3
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from supervisor.errors import StateError, SupervisorError
from supervisor.store import Store, Writer

NVIDIA_VERSION_PATH = Path("/proc/driver/nvidia/version")
# The search path systemd uses for a bare ExecStart= name, and the PATH it gives a service
# unless the unit sets Environment=PATH (systemd.exec(5), "Environment variables").
SYSTEMD_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin"

_EMPTY: Mapping[str, str] = MappingProxyType({})

# The probe runs inside the served interpreter (any Python >= 3.8), standard library only.
# Names are normalised as PEP 503 says; the first distribution of a name on sys.path wins, the
# one `import` would load. `Distribution.metadata` is parsed once per distribution because
# `.version` and `.name` would each parse it again. The marker environment is the PEP 508 one,
# so the supervisor can evaluate a requirement's markers as the served interpreter would.
_PROBE = r"""
import json, os, platform, re, sys
from importlib import metadata
want = set(json.loads(sys.argv[1]))
versions, requires = {}, {}
for dist in metadata.distributions():
    md = dist.metadata
    name = md["Name"]
    if not name:
        continue
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in versions:
        continue
    versions[key] = md["Version"]
    if key in want:
        requires[key] = md.get_all("Requires-Dist") or []
def fmt(info):
    text = "%d.%d.%d" % (info.major, info.minor, info.micro)
    if info.releaselevel != "final":
        text += info.releaselevel[0] + str(info.serial)
    return text
markers = {
    "implementation_name": sys.implementation.name,
    "implementation_version": fmt(sys.implementation.version),
    "os_name": os.name,
    "platform_machine": platform.machine(),
    "platform_python_implementation": platform.python_implementation(),
    "platform_release": platform.release(),
    "platform_system": platform.system(),
    "platform_version": platform.version(),
    "python_full_version": platform.python_version(),
    "python_version": ".".join(platform.python_version_tuple()[:2]),
    "sys_platform": sys.platform,
}
print(json.dumps({"python": platform.python_version(), "versions": versions,
                  "requires": requires, "markers": markers}))
"""

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
_DRIVER_VERSION = re.compile(r"\b(\d+\.\d+(?:\.\d+)*)\b")
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


class ProbeError(SupervisorError):
    """The served interpreter could not be run or did not report its environment."""


def normalize_name(name: str) -> str:
    """A distribution name as PEP 503 compares it (`Flashinfer_Python` → `flashinfer-python`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True, slots=True, kw_only=True)
class Probe:
    """Everything the probe script reports about an interpreter's environment."""

    python: str  # the interpreter's version, e.g. "3.11.7"
    versions: Mapping[str, str]  # every installed distribution, normalised name → version
    requires: Mapping[str, tuple[str, ...]]  # Requires-Dist of the distributions asked for
    markers: Mapping[str, str]  # the PEP 508 marker environment of that interpreter


def probe(python: Path, *, requires_of: Sequence[str] = (), timeout_s: float = 5.0) -> Probe:
    """Run `python` in isolated mode and read its installed distributions."""
    wanted = json.dumps(sorted({normalize_name(n) for n in requires_of}))
    argv = [str(python), "-I", "-c", _PROBE, wanted]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout_s, check=False)
    except OSError as exc:
        raise ProbeError(f"{python}: cannot run the interpreter: {exc.strerror}") from exc
    except subprocess.TimeoutExpired as exc:
        raise ProbeError(f"{python}: the environment probe took over {timeout_s:g} s") from exc
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise ProbeError(f"{python}: the environment probe failed: {tail[0]}")
    return _parse_probe(python, done.stdout)


def _parse_probe(python: Path, stdout: bytes) -> Probe:
    try:
        raw = json.loads(stdout)
        return Probe(
            python=str(raw["python"]),
            versions=MappingProxyType({str(k): str(v) for k, v in raw["versions"].items()}),
            requires=MappingProxyType(
                {str(k): tuple(map(str, v)) for k, v in raw["requires"].items()}
            ),
            markers=MappingProxyType({str(k): str(v) for k, v in raw["markers"].items()}),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProbeError(f"{python}: the environment probe printed no valid report") from exc


def read_nvidia_driver(path: Path = NVIDIA_VERSION_PATH) -> str | None:
    """The loaded NVIDIA kernel module's version, or None without a driver."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            found = _DRIVER_VERSION.search(line)
            return found.group(1) if found else None
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class EnvSnapshot:
    """The versions that matter for one start of a served unit."""

    python: str  # interpreter version
    packages: Mapping[str, str] = field(default_factory=lambda: _EMPTY)  # installed ones only
    checked: tuple[str, ...] = ()  # the normalised names looked for (installed or not)
    nvidia_driver: str | None = None
    executable: str | None = None  # the interpreter path, for display; never diffed

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict; `from_json` reads it back."""
        return {
            "python": self.python,
            "packages": dict(sorted(self.packages.items())),
            "checked": list(self.checked),
            "nvidia_driver": self.nvidia_driver,
            "executable": self.executable,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> EnvSnapshot:
        """Rebuild a snapshot written by `to_json`."""
        packages = {str(k): str(v) for k, v in raw.get("packages", {}).items()}
        driver, executable = raw.get("nvidia_driver"), raw.get("executable")
        return cls(
            python=str(raw["python"]),
            packages=MappingProxyType(packages),
            checked=tuple(str(n) for n in raw.get("checked", sorted(packages))),
            nvidia_driver=None if driver is None else str(driver),
            executable=None if executable is None else str(executable),
        )


def snapshot(
    python: Path,
    packages: Sequence[str],
    *,
    timeout_s: float = 5,
    nvidia_version_path: Path = NVIDIA_VERSION_PATH,
) -> EnvSnapshot:
    """Record the interpreter version, the given packages' versions and the NVIDIA driver.

    Blocking (a subprocess of up to `timeout_s`): call it through `asyncio.to_thread` from the
    daemon. Raises `ProbeError` when the interpreter cannot be run.
    """
    found = probe(python, timeout_s=timeout_s)
    return snapshot_from_probe(
        found, packages, executable=python, nvidia_driver=read_nvidia_driver(nvidia_version_path)
    )


def snapshot_from_probe(
    found: Probe, packages: Sequence[str], *, executable: Path, nvidia_driver: str | None
) -> EnvSnapshot:
    """The snapshot a probe already run implies (preflight probes once for both uses)."""
    checked = tuple(sorted({normalize_name(n) for n in packages}))
    return EnvSnapshot(
        python=found.python,
        packages=MappingProxyType({n: found.versions[n] for n in checked if n in found.versions}),
        checked=checked,
        nvidia_driver=nvidia_driver,
        executable=str(executable),
    )


class ChangeKind(StrEnum):
    """How one package (or the interpreter, or the driver) differs between two snapshots."""

    ADDED = "added"
    REMOVED = "removed"
    CHANGED = "changed"


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """One difference between two snapshots; `name` is a package, `python` or `nvidia-driver`."""

    name: str
    before: str | None
    after: str | None

    @property
    def kind(self) -> ChangeKind:
        """Added, removed or changed."""
        if self.before is None:
            return ChangeKind.ADDED
        if self.after is None:
            return ChangeKind.REMOVED
        return ChangeKind.CHANGED

    def __str__(self) -> str:
        if self.before is None:
            return f"{self.name} added {self.after}"
        if self.after is None:
            return f"{self.name} removed (was {self.before})"
        return f"{self.name} {self.before} → {self.after}"


def diff(before: EnvSnapshot, after: EnvSnapshot) -> list[Change]:
    """What changed from `before` to `after`: interpreter, driver, then packages by name.

    Only packages both snapshots looked for are compared, so adding a name to the configured list
    does not show up as a package that appeared.
    """
    changes = [
        Change(name=name, before=old, after=new)
        for name, old, new in (
            ("python", before.python, after.python),
            ("nvidia-driver", before.nvidia_driver, after.nvidia_driver),
        )
        if old != new
    ]
    for name in sorted(set(before.checked) & set(after.checked)):
        old, new = before.packages.get(name), after.packages.get(name)
        if old != new:
            changes.append(Change(name=name, before=old, after=new))
    return changes


def render_changes(changes: Sequence[Change]) -> str:
    """One line for a notification or a log: `flashinfer-python 0.6.3 → 0.6.4; torch …`."""
    return "; ".join(str(c) for c in changes) if changes else "no changes"


def is_serving_line(text: str) -> bool:
    """True when a served unit's line says the server is up and answering requests."""
    # Every line of a start is asked until it is good: reject most without a regex.
    if not any(hint in text for hint in _SERVING_HINTS):
        return False
    return _SERVING.search(_ANSI.sub("", text).strip()) is not None


def interpreter_from_exec_start(
    argv: Sequence[str], *, search_path: str = SYSTEMD_DEFAULT_PATH
) -> Path | None:
    """The Python interpreter a unit's ExecStart= runs, or None when it runs no Python.

    Understands `python -m ...`, console scripts such as `/opt/venv/bin/vllm` (read through their
    shebang), `env` and shell wrappers, and systemd's ExecStart prefixes (`-`, `@`, `+`, ...).
    A binary such as TGI's `text-generation-launcher` gives None. Symlinks are not resolved:
    a venv's `bin/python` must be run by that path to see the venv.
    """
    program = _program(list(argv), search_path)
    if program is None:
        return None
    if _PYTHON_NAME.match(Path(program).name):
        return _locate(program, search_path)
    path = _locate(program, search_path)
    return None if path is None else _shebang_interpreter(path, search_path)


def _program(argv: list[str], search_path: str) -> str | None:
    """The command an ExecStart= line finally runs, after its wrappers."""
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
            return argv[0]
    return None


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


def _shebang_interpreter(script: Path, search_path: str) -> Path | None:
    """The python a script's `#!` line names (directly, through env, or pip's sh trampoline)."""
    try:
        with script.open("rb") as handle:
            lines = handle.read(4096).decode(errors="replace").splitlines()
    except OSError:
        return None
    if not lines or not lines[0].startswith("#!"):
        return None
    words = lines[0][2:].split()
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


_SCHEMA = """
CREATE TABLE IF NOT EXISTS environment_log (
    unit TEXT NOT NULL,
    invocation_id TEXT NOT NULL,
    started REAL NOT NULL,
    snapshot TEXT NOT NULL,
    good INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (unit, invocation_id)
);
CREATE INDEX IF NOT EXISTS environment_log_unit_started ON environment_log (unit, started);
"""


class EnvironmentLog:
    """Snapshots per unit and invocation, in the state database, with the good starts marked.

    Each unit keeps its newest `keep` snapshots plus its newest good one, so a long restart loop
    cannot grow the database without bound or push out the baseline.
    """

    def __init__(self, store: Store, *, keep: int = 100) -> None:
        self.store = store
        self.keep = keep
        try:
            store.connection.executescript(_SCHEMA)
        except sqlite3.Error as exc:
            raise StateError(f"{store.path}: cannot create the environment log: {exc}") from exc

    def record_start(
        self, unit: str, invocation_id: str, snapshot: EnvSnapshot, time: float
    ) -> None:
        """Keep the snapshot taken when `invocation_id` started (at `time`, epoch seconds).

        A second call for the same invocation (a journal replay) keeps the first snapshot.
        """
        with self.store.transaction() as db:
            self.start_writer(unit, invocation_id, snapshot, time)(db)

    def start_writer(
        self, unit: str, invocation_id: str, snapshot: EnvSnapshot, time: float
    ) -> Writer:
        """`record_start` as a writer for `Store.commit_batch(extra=...)`, to share its commit."""
        text = json.dumps(snapshot.to_json(), sort_keys=True, separators=(",", ":"))

        def write(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT OR IGNORE INTO environment_log (unit, invocation_id, started, snapshot) "
                "VALUES (?, ?, ?, ?)",
                (unit, invocation_id, time, text),
            )
            db.execute(_PRUNE, (unit, unit, self.keep, unit))

        return write

    def mark_good(self, unit: str, invocation_id: str) -> None:
        """Mark an invocation's start as good: it ran long enough or reached the serving state."""
        with self.store.transaction() as db:
            self.good_writer(unit, invocation_id)(db)

    def good_writer(self, unit: str, invocation_id: str) -> Writer:
        """`mark_good` as a writer for `Store.commit_batch(extra=...)`."""

        def write(db: sqlite3.Connection) -> None:
            db.execute(
                "UPDATE environment_log SET good = 1 WHERE unit = ? AND invocation_id = ?",
                (unit, invocation_id),
            )

        return write

    def last_good(self, unit: str) -> EnvSnapshot | None:
        """The snapshot of the unit's most recent good start, if any."""
        rows = self._query(
            "SELECT snapshot FROM environment_log WHERE unit = ? AND good = 1 "
            "ORDER BY started DESC, rowid DESC LIMIT 1",
            (unit,),
        )
        return EnvSnapshot.from_json(json.loads(rows[0][0])) if rows else None

    def for_invocation(self, unit: str, invocation_id: str) -> EnvSnapshot | None:
        """The snapshot recorded when `invocation_id` started, if any."""
        rows = self._query(
            "SELECT snapshot FROM environment_log WHERE unit = ? AND invocation_id = ?",
            (unit, invocation_id),
        )
        return EnvSnapshot.from_json(json.loads(rows[0][0])) if rows else None

    def changes_since_last_good(self, unit: str, invocation_id: str) -> list[Change]:
        """What changed between the last good start before `invocation_id` and `invocation_id`.

        Empty when either snapshot is missing (no good start yet, or the start was not recorded):
        drift is reported only against a known-good baseline.
        """
        rows = self._query(
            "SELECT base.snapshot, this.snapshot FROM environment_log AS this "
            "JOIN environment_log AS base ON base.unit = this.unit AND base.good = 1 "
            "AND base.invocation_id != this.invocation_id AND base.started <= this.started "
            "WHERE this.unit = ? AND this.invocation_id = ? "
            "ORDER BY base.started DESC, base.rowid DESC LIMIT 1",
            (unit, invocation_id),
        )
        if not rows:
            return []
        base, this = (EnvSnapshot.from_json(json.loads(text)) for text in rows[0])
        return diff(base, this)

    def _query(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        try:
            return self.store.connection.execute(sql, args).fetchall()
        except sqlite3.Error as exc:
            raise StateError(f"{self.store.path}: read failed: {exc}") from exc


# Keep a unit's newest `keep` rows and its newest good row; delete the rest.
_PRUNE = """
DELETE FROM environment_log WHERE unit = ?
AND rowid NOT IN (
    SELECT rowid FROM environment_log WHERE unit = ? ORDER BY started DESC, rowid DESC LIMIT ?)
AND rowid NOT IN (
    SELECT rowid FROM environment_log WHERE unit = ? AND good = 1
    ORDER BY started DESC, rowid DESC LIMIT 1)
"""
