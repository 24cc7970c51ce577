"""`vllm-supervisor setup`: install the supervisor under systemd from its config, in one command.

From the config's [[unit]] list it writes the supervisor's unit, its sysusers.d entry, a
drop-in with the gate for every served unit, a polkit rule generated from the same unit names
(one source of truth for who may be stopped), and the journal catalog; creates the user;
checks the units with `systemd-analyze verify`; reloads systemd and the catalog; and enables
and starts the daemon. Run again, it rewrites only what changed. `--print` shows the files and
changes nothing; `--uninstall` stops the daemon and removes every file it wrote (`--purge`
also its state, runtime directory and user). What it cannot do is refused in one line.

Every file it writes starts with MARKER, so `--uninstall` removes only its own files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ..actions.systemd import SystemdClient, ask_once
from ..config import DEFAULT_RUNTIME_DIR, DEFAULT_STATE_DIR, Config
from ..environment.execstart import interpreter_from_exec_start
from ..environment.reach import environment_root, hidden_by
from ..errors import ConfigError, SupervisorError, SystemdError
from ..util.files import atomic_write

MARKER = "# Written by `vllm-supervisor setup`; `vllm-supervisor setup --uninstall` removes it."
DEPLOY = Path(__file__).resolve().parent.parent / "data" / "deploy"
INSTALLED_CONFIG = Path("/etc/vllm-supervisor/supervisor.toml")
DAEMON_UNIT = "vllm-supervisor.service"
USER = "vllm-supervisor"
DEFAULT_PROGRAM = "/usr/local/bin/vllm-supervisor"
SHIPPED_GATE_DIRS = " --runtime-dir /run/vllm-supervisor --state-dir /var/lib/vllm-supervisor"
COMMAND_TIMEOUT_S = 60.0
SYSTEMD_TIMEOUT_S = 2.0  # one D-Bus call while reading the units' ExecStart=
UNIT_DIR = Path("/etc/systemd/system")
DAEMON_UNIT_FILE = UNIT_DIR / DAEMON_UNIT
SYSUSERS_FILE = Path("/etc/sysusers.d/vllm-supervisor.conf")
POLKIT_FILE = Path("/etc/polkit-1/rules.d/50-vllm-supervisor.rules")
CATALOG_FILE = Path("/usr/local/lib/systemd/catalog/vllm-supervisor.catalog")
DROP_IN = "10-vllm-supervisor.conf"
ENVIRONMENTS_DROP_IN = UNIT_DIR / f"{DAEMON_UNIT}.d" / "20-served-environments.conf"
CREDENTIAL_FILE = Path("/etc/vllm-supervisor/slack-webhook")  # the unit's LoadCredential=

Run = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]


class SetupError(SupervisorError):
    """Setup cannot go on (not root, no config, a unit file systemd rejects)."""


@dataclass(frozen=True, slots=True)
class InstalledFile:
    """One file setup owns: where, what, and with which mode."""

    path: Path
    text: str
    mode: int = 0o644


def planned_files(
    config: Config,
    *,
    config_path: Path,
    program: str,
    interpreters: Mapping[str, str] | None = None,
) -> list[InstalledFile]:
    """Every file setup installs for `config`, with its final text.

    `interpreters` (unit → the Python its ExecStart= runs) adds to the units' configured
    `python`; one under /home or /tmp gets its environment bound read-only into the daemon's
    sandbox, so drift can probe it."""
    if not config.units:
        raise ConfigError(f"{config_path}: no [[unit]] to supervise: list the served units first")
    flag = f" --config {config_path}"
    units = [u.name for u in config.units]
    files = [
        InstalledFile(
            DAEMON_UNIT_FILE,
            _template("systemd/vllm-supervisor.service")
            .replace(f"{DEFAULT_PROGRAM} run --config {INSTALLED_CONFIG}", f"{program} run{flag}")
            .replace(
                f"{DEFAULT_PROGRAM} check-config {INSTALLED_CONFIG}",
                f"{program} check-config {config_path}",
            ),
        ),
        InstalledFile(SYSUSERS_FILE, _template("sysusers.d/vllm-supervisor.conf")),
        InstalledFile(POLKIT_FILE, polkit_rule(units)),
        InstalledFile(CATALOG_FILE, _template("catalog/vllm-supervisor.catalog")),
    ]
    # The gate is told the daemon's directories, so it finds a quarantine record even when the
    # config it reads does not load.
    directories = (
        f" --runtime-dir {config.state.runtime_dir} --state-dir {config.state.state_dir}"
    )
    gate = _template("systemd/vllm.service.d/10-vllm-supervisor.conf").replace(
        f"{DEFAULT_PROGRAM} gate{SHIPPED_GATE_DIRS} %n", f"{program} gate{flag}{directories} %n"
    )
    files += [InstalledFile(drop_in(unit), gate) for unit in units]
    pythons = {**(interpreters or {}), **{u.name: u.python for u in config.units if u.python}}
    visible = served_environments(pythons.values())
    if visible:
        files.append(InstalledFile(ENVIRONMENTS_DROP_IN, visible))
    return [InstalledFile(f.path, _marked(f.text), f.mode) for f in files]


def served_environments(interpreters: Iterable[str]) -> str | None:
    """The daemon's drop-in that lets it read the served environments its sandbox hides."""
    roots = sorted({environment_root(p) for p in interpreters if hidden_by(p) is not None})
    if not roots:
        return None
    lines = [
        "# The served units' environments, read-only, so environment drift can probe their",
        "# interpreters (ProtectHome=yes would hide /home, PrivateTmp=yes /tmp).",
        "[Service]",
    ]
    if any(hidden_by(r) == "ProtectHome=" for r in roots):
        lines.append("ProtectHome=tmpfs")
    lines += [f"BindReadOnlyPaths={root}" for root in roots]
    return "\n".join(lines) + "\n"


def exec_start_interpreters(units: Iterable[str]) -> dict[str, str]:
    """The Python each unit's ExecStart= runs, as systemd reports it over one bus connection
    (units without one, or that systemd cannot say, are left out)."""
    names = list(units)

    async def argvs(client: SystemdClient) -> dict[str, list[str]]:
        found = {}
        for unit in names:
            with contextlib.suppress(SystemdError):
                found[unit] = await client.exec_start(unit)
        return found

    if not names:
        return {}
    try:
        by_unit = ask_once(argvs, timeout_s=SYSTEMD_TIMEOUT_S)
    except (SystemdError, OSError, TimeoutError):
        return {}
    pythons = {unit: interpreter_from_exec_start(argv) for unit, argv in by_unit.items() if argv}
    return {unit: str(python) for unit, python in pythons.items() if python is not None}


def drop_in(unit: str) -> Path:
    """Where the gate's drop-in of a served unit goes."""
    return UNIT_DIR / f"{unit}.d" / DROP_IN


def polkit_rule(units: Sequence[str]) -> str:
    """The shipped rule with its unit list replaced by the configured units."""
    shipped = _template("polkit/50-vllm-supervisor.rules")
    start = shipped.index("var SUPERVISED_UNITS = ")
    end = shipped.index(";", start)
    generated = f"var SUPERVISED_UNITS = {json.dumps(sorted(units))}"
    text = shipped[:start] + generated + shipped[end:]
    return text.replace(
        "Edit SUPERVISED_UNITS to match the [[unit]] names in\n// "
        '/etc/vllm-supervisor/supervisor.toml (full names, e.g. "vllm@0.service").',
        "SUPERVISED_UNITS is generated from the [[unit]] names of the config; run\n// "
        "`vllm-supervisor setup` again after changing them.",
    )


def _template(name: str) -> str:
    path = DEPLOY / name
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SetupError(f"{path}: the packaged deploy file is missing: {exc.strerror}") from exc


def _marked(text: str) -> str:
    comment = "//" if text.lstrip().startswith("//") else "#"
    return f"{comment} {MARKER.removeprefix('# ')}\n{text}"


def _is_ours(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            return MARKER.removeprefix("# ") in handle.readline()
    except OSError:
        return False


def _command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(argv), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SetupError(f"{argv[0]}: cannot run it: {exc}") from exc


def _must(run: Run, *argv: str) -> None:
    done = run(argv)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise SetupError(f"{' '.join(argv)} failed: {said[-1] if said else done.returncode}")


def default_program() -> str:
    """The command the units run: vllm-supervisor on PATH, else the one running now."""
    found = shutil.which("vllm-supervisor")
    if found:
        return found
    return str(Path(sys.argv[0]).resolve()) if sys.argv and sys.argv[0] else DEFAULT_PROGRAM


def install(
    config: Config,
    *,
    config_path: Path,
    program: str,
    start: bool = True,
    out: TextIO,
    run: Run = _command,
) -> int:
    """Write what changed, create the user, verify, reload, enable and start."""
    _need_root()
    if not config_path.is_file():
        raise SetupError(
            f"{config_path}: no config: write it first (config/supervisor.toml is a start)"
        )
    interpreters = exec_start_interpreters(u.name for u in config.units if not u.python)
    files = planned_files(
        config, config_path=config_path, program=program, interpreters=interpreters
    )
    for file in files:
        if file.path.exists() and not _is_ours(file.path):
            raise SetupError(f"{file.path}: exists and was not written by setup: move it away")
    changed = 0
    for file in files:
        current = file.path.read_text(encoding="utf-8") if file.path.exists() else None
        if current == file.text:
            out.write(f"unchanged {file.path}\n")
            continue
        atomic_write(file.path, file.text, mode=file.mode)
        out.write(f"wrote     {file.path}\n")
        changed += 1
    credential = CREDENTIAL_FILE
    if not credential.exists():  # LoadCredential= fails the unit without it; empty = Slack off
        atomic_write(credential, "", mode=0o600)
        out.write(f"created   {credential} (empty: Slack off; put the webhook URL in it)\n")
    _must(run, "systemd-sysusers", str(SYSUSERS_FILE))
    _must(run, "systemd-analyze", "verify", str(DAEMON_UNIT_FILE))
    _must(run, "systemctl", "daemon-reload")
    _must(run, "journalctl", "--update-catalog")
    if start:
        _must(run, "systemctl", "enable", DAEMON_UNIT)
        verb = "restart" if changed else "start"
        _must(run, "systemctl", verb, DAEMON_UNIT)
        out.write(f"{verb}ed  {DAEMON_UNIT}\n")
    units = ", ".join(u.name for u in config.units)
    out.write(f"setup done: {changed} file(s) changed; supervising {units}\n")
    return 0


def uninstall(config: Config, *, purge: bool = False, out: TextIO, run: Run = _command) -> int:
    """Stop and disable the daemon, remove every file setup wrote (and, with `purge`, the
    daemon's state, runtime directory and user)."""
    _need_root()
    run(("systemctl", "disable", "--now", DAEMON_UNIT))
    candidates = [DAEMON_UNIT_FILE, ENVIRONMENTS_DROP_IN, SYSUSERS_FILE, POLKIT_FILE, CATALOG_FILE]
    candidates += [drop_in(u.name) for u in config.units]
    candidates += sorted(UNIT_DIR.glob(f"*.d/{DROP_IN}"))  # units dropped from the config
    for path in dict.fromkeys(candidates):
        if path.exists() and _is_ours(path):
            path.unlink()
            out.write(f"removed   {path}\n")
            if path.parent.name.endswith(".d"):
                with contextlib.suppress(OSError):
                    path.parent.rmdir()  # the drop-in directory, when nothing else is in it
    if purge:
        for directory in (config.state.state_dir, config.state.runtime_dir):
            if directory in (DEFAULT_STATE_DIR, DEFAULT_RUNTIME_DIR) and directory.exists():
                shutil.rmtree(directory)
                out.write(f"removed   {directory}\n")
        if run(("getent", "passwd", USER)).returncode == 0:
            _must(run, "userdel", USER)
            out.write(f"removed   user {USER}\n")
    run(("systemctl", "daemon-reload"))
    run(("journalctl", "--update-catalog"))
    out.write("uninstalled\n")
    return 0


def print_files(config: Config, *, config_path: Path, program: str, out: TextIO) -> int:
    """Show every file setup would write, and change nothing."""
    for file in planned_files(config, config_path=config_path, program=program):
        out.write(f"==> {file.path} (mode {file.mode:04o})\n{file.text}\n")
    return 0


def missing_drop_ins(config: Config, root: Path = Path("/")) -> list[str]:
    """Configured units without the gate drop-in in any systemd unit directory (check-config)."""
    directories = ("etc/systemd/system", "run/systemd/system", "usr/lib/systemd/system")
    missing = []
    for unit in config.units:
        found = any((root / d / f"{unit.name}.d" / DROP_IN).exists() for d in directories)
        if not found:
            missing.append(unit.name)
    return missing


def _need_root() -> None:
    if os.geteuid() != 0:
        raise SetupError("setup writes /etc and creates a system user: run it as root")
