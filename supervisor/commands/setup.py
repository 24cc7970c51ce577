"""`vllm-supervisor setup`: install the supervisor under systemd from its config, in one command.

From the config's [[unit]] list it writes the supervisor's unit, its sysusers.d entry, a
drop-in with the gate for every served unit, a polkit rule generated from the same unit names
(one source of truth for who may be stopped), the journal catalog, and the man page and
shell completions where man, bash and zsh look (/usr/local/share); creates the user;
checks the units with `systemd-analyze verify`; reloads systemd and the catalog; and enables
and starts the daemon. Run again, it rewrites only what changed. `--print` shows the files and
changes nothing; `--uninstall` stops the daemon and removes every file it wrote (`--purge`
also its state, runtime directory and user). What it cannot do is refused in one line.

Every file it writes starts with MARKER (a zsh completion: its second line, after `#compdef`),
so `--uninstall` removes only its own files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ..actions import SystemdClient, ask_once
from ..config import DEFAULT_RUNTIME_DIR, DEFAULT_STATE_DIR, Config, load_config
from ..environment import (
    HIDING,
    environment_root,
    hidden_by,
    interpreter_from_exec_start,
    shebang_words,
)
from ..errors import ConfigError, SupervisorError, SystemdError
from ..util.safe_write import StagedFiles, read_regular, untrusted, unwritable
from .options import INSTALLED_CONFIG

MARKER = "# Written by `vllm-supervisor setup`; `vllm-supervisor setup --uninstall` removes it."
DEPLOY = Path(__file__).resolve().parent.parent / "data" / "deploy"
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
# man, bash-completion and zsh search /usr/local/share without being told; a venv's share/,
# where the wheel puts the same files, none of them searches.
SHARE_DIR = Path("/usr/local/share")
# The man page and the completions generated from the parser (supervisor/cli_docs.py writes
# them into deploy/cli/ in share/'s layout; the package carries them as data/deploy/cli/).
CLI_DOCS = (
    "man/man1/vllm-supervisor.1",
    "bash-completion/completions/vllm-supervisor",
    "zsh/site-functions/_vllm-supervisor",
)
TRUST_TOP = Path("/")  # where the checks of what root may trust stop (tests: their temp dir)
INSTALL_HINT = (
    "install into a root-owned venv (python3 -m venv /opt/vllm-supervisor &&"
    " /opt/vllm-supervisor/bin/pip install vllm_supervisor-*.whl: deploy/README.md) and run its"
    " setup, or pass --program a root-owned vllm-supervisor outside /home, /root, /run/user,"
    " /tmp, /var/tmp"
)
POLKIT_ACCOUNTS = ("polkitd", "polkit")
ZSH_FIRST_LINE = "#compdef "
_PYTHON_VERSION = re.compile(r"^python(\d+\.\d+)")

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
    real_names: Mapping[str, str] | None = None,
) -> list[InstalledFile]:
    """Every file setup installs for `config`, with its final text.

    `interpreters` (unit → the Python its ExecStart= runs) adds to the units' configured
    `python`; one under /home or /tmp gets its environment bound read-only into the daemon's
    sandbox, so drift can probe it. `real_names` (alias → the unit's real name): the gate and
    the polkit rule are for the real unit (systemd asks polkit about its real name, and
    applies an alias's drop-ins only while the alias link exists)."""
    if not config.units:
        raise ConfigError(f"{config_path}: no [[unit]] to supervise: list the served units first")
    flag = f" --config {config_path}"
    units = list(dict.fromkeys((real_names or {}).get(u.name, u.name) for u in config.units))
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
    directories = f" --runtime-dir {config.state.runtime_dir} --state-dir {config.state.state_dir}"
    gate = _template("systemd/vllm.service.d/10-vllm-supervisor.conf").replace(
        f"{DEFAULT_PROGRAM} gate{SHIPPED_GATE_DIRS} %n", f"{program} gate{flag}{directories} %n"
    )
    files += [InstalledFile(drop_in(unit), gate) for unit in units]
    if not _the_wheel_installed_them():
        files += [InstalledFile(SHARE_DIR / name, _template(f"cli/{name}")) for name in CLI_DOCS]
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


@dataclass(frozen=True, slots=True)
class SystemdFacts:
    """What systemd says of the configured units (`trouble`: why it could not be asked)."""

    interpreters: dict[str, str] = field(default_factory=dict)
    not_found: tuple[str, ...] = ()
    trouble: str | None = None
    aliases: dict[str, str] = field(default_factory=dict)  # configured alias → real name
    # Units whose loaded ExecCondition= runs no gate of ours (none installed, a drop-in that
    # empties it): systemd's word, whatever files say.
    ungated: tuple[str, ...] = ()


def ask_systemd(units: Sequence[str], *, exec_start_of: Iterable[str] = ()) -> SystemdFacts:
    """Which of `units` systemd does not know, which are aliases (and of which unit), and the
    Python each of `exec_start_of` runs (its ExecStart=; units without one, or that systemd
    cannot say, are left out), over one bus connection."""
    wanted = set(exec_start_of)

    async def question(client: SystemdClient) -> SystemdFacts:
        argvs: dict[str, list[str]] = {}
        not_found, aliases, ungated = [], {}, []
        for unit in units:
            try:
                real, _ = await client.unit_names(unit)
            except SystemdError as exc:
                if exc.reason != "no_such_unit":
                    raise
                not_found.append(unit)
                continue
            if real != unit:
                aliases[unit] = real
            with contextlib.suppress(SystemdError):
                if not (await client.unit_state(real)).gated:
                    ungated.append(unit)
            if unit in wanted:
                with contextlib.suppress(SystemdError):
                    argvs[unit] = await client.exec_start(unit)
        pythons = {unit: interpreter_from_exec_start(argv) for unit, argv in argvs.items() if argv}
        found = {unit: str(python) for unit, python in pythons.items() if python is not None}
        return SystemdFacts(
            interpreters=found,
            not_found=tuple(not_found),
            aliases=aliases,
            ungated=tuple(ungated),
        )

    if not units:
        return SystemdFacts()
    try:
        return ask_once(question, timeout_s=SYSTEMD_TIMEOUT_S)
    except (SystemdError, OSError, TimeoutError) as exc:
        return SystemdFacts(trouble=str(exc) or type(exc).__name__)


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


def _the_wheel_installed_them() -> bool:
    """Whether this installation's own share/ is SHARE_DIR (a system-wide install into
    /usr/local): the wheel's data files put the man page and completions there already."""
    return os.path.realpath(Path(sys.prefix) / "share") == os.path.realpath(SHARE_DIR)


def _marked(text: str) -> str:
    """`text` with MARKER as a comment of its language, first; second after a zsh
    completion's `#compdef`, which compinit reads on the first line only."""
    mark = MARKER.removeprefix("# ")
    first, _, rest = text.partition("\n")
    if first.startswith(ZSH_FIRST_LINE):
        return f"{first}\n# {mark}\n{rest}"
    if text.startswith(".TH"):  # a man page: a roff comment
        return f'.\\" {mark}\n{text}'
    comment = "//" if text.lstrip().startswith("//") else "#"
    return f"{comment} {mark}\n{text}"


def _is_ours(path: Path) -> bool:
    """Whether `path` is a regular file setup wrote (never through a symlink)."""
    try:
        text = read_regular(path)
    except OSError:
        return False
    if text is None:
        return False
    first, second = [*text.split("\n", 2), "", ""][:2]
    mark = MARKER.removeprefix("# ")
    return mark in first or (first.startswith(ZSH_FIRST_LINE) and mark in second)


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


@dataclass(frozen=True, slots=True)
class Plan:
    """What setup will write, once every check passed, and what it should tell."""

    files: list[InstalledFile]  # every file setup owns
    changed: list[InstalledFile]  # those to write
    credential: InstalledFile | None  # the credential file, when it is missing
    warnings: list[str]
    stale: list[Path] = field(default_factory=list)  # setup's own gates of aliases, to remove
    supervised: tuple[str, ...] = ()  # the units' real names


def plan(config: Config, *, config_path: Path, program: str) -> Plan:
    """Every check of setup, before it writes anything: root, the config, the program root
    will run, each target directory, each file in the way; and what systemd says."""
    _need_root()
    if not config_path.is_file():
        raise SetupError(
            f"{config_path}: no config: write it first (config/supervisor.toml is a start)"
        )
    _refuse(program_problem(program, top=TRUST_TOP))
    names = [u.name for u in config.units]
    facts = ask_systemd(names, exec_start_of=[u.name for u in config.units if not u.python])
    files = planned_files(
        config,
        config_path=config_path,
        program=program,
        interpreters=facts.interpreters,
        real_names=facts.aliases,
    )
    _refuse(targets_problem([*(f.path for f in files), CREDENTIAL_FILE], top=TRUST_TOP))
    credential = None  # LoadCredential= fails the unit without it; empty = Slack off
    if not CREDENTIAL_FILE.exists() and not CREDENTIAL_FILE.is_symlink():
        credential = InstalledFile(CREDENTIAL_FILE, "", mode=0o600)
    warnings = config_warnings(config, config_path, facts)
    # A gate an earlier setup wrote under an alias's name: systemd would apply it too (while
    # the alias link exists), beside the one now written for the real unit.
    stale = [drop_in(alias) for alias in facts.aliases if _is_ours(drop_in(alias))]
    supervised = tuple(dict.fromkeys(facts.aliases.get(n, n) for n in names))
    return Plan(files, _changed(files), credential, warnings, stale, supervised)


def install(
    config: Config,
    *,
    config_path: Path,
    program: str,
    start: bool = True,
    out: TextIO,
    run: Run = _command,
) -> int:
    """Check everything, then write what changed, create the user, verify, reload, enable and
    start. A refusal comes before the first write: it leaves the system as it was."""
    checked = plan(config, config_path=config_path, program=program)
    for warning in checked.warnings:
        sys.stderr.write(f"vllm-supervisor: warning: {warning}\n")
    _write_all_or_nothing(checked.changed + ([checked.credential] if checked.credential else []))
    for file in checked.files:
        out.write(f"{'wrote    ' if file in checked.changed else 'unchanged'} {file.path}\n")
    for path in checked.stale:
        _remove_drop_in(path)
        out.write(f"removed   {path} (an alias's: the gate is now the real unit's)\n")
    if checked.credential is not None:
        path = checked.credential.path
        out.write(f"created   {path} (empty: Slack off; put the webhook URL in it)\n")
    _must(run, "systemd-sysusers", str(SYSUSERS_FILE))
    _must(run, "systemd-analyze", "verify", str(DAEMON_UNIT_FILE))
    _must(run, "systemctl", "daemon-reload")
    _must(run, "journalctl", "--update-catalog")
    if start:
        _must(run, "systemctl", "enable", DAEMON_UNIT)
        verb = "restart" if checked.changed else "start"
        _must(run, "systemctl", verb, DAEMON_UNIT)
        out.write(f"{verb}ed  {DAEMON_UNIT}\n")
    units = ", ".join(checked.supervised)
    out.write(f"setup done: {len(checked.changed)} file(s) changed; supervising {units}\n")
    return 0


def _refuse(problem: str | None) -> None:
    if problem is not None:
        raise SetupError(problem)


def _changed(files: Sequence[InstalledFile]) -> list[InstalledFile]:
    """The files whose text differs from what is installed; anything in the way that setup
    did not write (a file, a symlink, a directory) is refused."""
    changed = []
    for file in files:
        if (file.path.exists() or file.path.is_symlink()) and not _is_ours(file.path):
            raise SetupError(f"{file.path}: exists and was not written by setup: move it away")
        try:
            current = read_regular(file.path)
        except OSError as exc:
            raise SetupError(f"{file.path}: cannot read it: {exc.strerror}") from exc
        if current != file.text:
            changed.append(file)
    return changed


def _write_all_or_nothing(files: Sequence[InstalledFile]) -> None:
    staged = StagedFiles()
    try:
        for file in files:
            staged.add(file.path, file.text.encode("utf-8"), mode=file.mode)
    except OSError as exc:
        staged.discard()
        raise SetupError(f"{_os_error(exc)}: nothing was changed") from exc
    try:
        staged.commit()
    except OSError as exc:
        raise SetupError(f"{_os_error(exc)}: some files were replaced; run setup again") from exc


def _os_error(exc: OSError) -> str:
    return f"{exc.filename}: cannot write it: {exc.strerror}" if exc.filename else str(exc)


def uninstall(config: Config, *, purge: bool = False, out: TextIO, run: Run = _command) -> int:
    """Stop and disable the daemon, remove every file setup wrote (and, with `purge`, the
    daemon's state, runtime directory and user)."""
    _need_root()
    run(("systemctl", "disable", "--now", DAEMON_UNIT))
    candidates = [DAEMON_UNIT_FILE, ENVIRONMENTS_DROP_IN, SYSUSERS_FILE, POLKIT_FILE, CATALOG_FILE]
    candidates += [drop_in(u.name) for u in config.units]
    candidates += [SHARE_DIR / name for name in CLI_DOCS]
    candidates += sorted(UNIT_DIR.glob(f"*.d/{DROP_IN}"))  # units dropped from the config
    for path in dict.fromkeys(candidates):
        if path.exists() and _is_ours(path):
            _remove_drop_in(path)
            out.write(f"removed   {path}\n")
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


def _remove_drop_in(path: Path) -> None:
    """Remove a file setup wrote, and its drop-in directory when nothing else is in it."""
    path.unlink()
    if path.parent.name.endswith(".d"):
        with contextlib.suppress(OSError):
            path.parent.rmdir()


def print_files(config: Config, *, config_path: Path, program: str, out: TextIO) -> int:
    """Show every file setup would write, and change nothing."""
    for file in planned_files(config, config_path=config_path, program=program):
        out.write(f"==> {file.path} (mode {file.mode:04o})\n{file.text}\n")
    return 0


def missing_drop_ins(
    config: Config, root: Path = Path("/"), real_names: Mapping[str, str] | None = None
) -> list[str]:
    """Configured units without the gate drop-in in any systemd unit directory (check-config);
    for an alias in `real_names`, the drop-in of the unit it names."""
    directories = ("etc/systemd/system", "run/systemd/system", "usr/lib/systemd/system")
    missing = []
    for unit in config.units:
        name = (real_names or {}).get(unit.name, unit.name)
        found = any((root / d / f"{name}.d" / DROP_IN).exists() for d in directories)
        if not found:
            missing.append(unit.name)
    return missing


def _need_root() -> None:
    if os.geteuid() != 0:
        raise SetupError("setup writes /etc and creates a system user: run it as root")


def program_problem(program: str, *, top: Path = TRUST_TOP) -> str | None:
    """Why the units must not run `program` (root runs it: `ExecCondition=+`), or None.

    Refused: a relative or missing path; a program, interpreter, venv part or directory above
    them that another account could change (checked up to `top`); a program or interpreter
    the daemon's sandbox hides (it would fail with status=203/EXEC)."""
    path = Path(program)
    if not path.is_absolute():
        return f"--program {program}: give the absolute path of a root-owned vllm-supervisor"
    if not path.is_file():
        return f"{program}: no such program; {INSTALL_HINT}"
    interpreters = program_interpreters(path)
    for part in [path, *_environments(interpreters)]:
        found = untrusted(part, top=top)
        if found is not None:
            return (
                f"{found}: root would run code that account controls (the gates' `+`"
                f" ExecCondition=, the daemon's ExecStart= via {program}); {INSTALL_HINT}"
            )
    for part in [path, *interpreters]:
        for seen in dict.fromkeys([part, Path(os.path.realpath(part))]):
            hidden = hidden_from_daemon(seen)
            if hidden is not None:
                return f"{seen} {hidden}: the daemon could not run {program}; {INSTALL_HINT}"
    return None


def hidden_from_daemon(path: Path) -> str | None:
    """How the daemon's unit hides `path` (its ProtectHome=, PrivateTmp=), or None."""
    setting = hidden_by(str(path))
    if setting is None:
        return None
    roots = dict(HIDING)[setting]
    root = next(r for r in roots if path == Path(r) or Path(r) in path.parents)
    return f"is under {root}, which the daemon's unit hides ({setting}yes; status=203/EXEC)"


def program_interpreters(program: Path) -> list[Path]:
    """What running `program` runs first: its `#!` interpreter and, through `env` or pip's
    sh trampoline, the Python behind it."""
    try:
        with program.open("rb") as handle:
            head = handle.read(256).decode(errors="replace")
    except OSError:
        return []
    found = [Path(command)] if (command := shebang_command(head)) is not None else []
    python = interpreter_from_exec_start([str(program)])
    if python is not None:
        found.append(python)
    return list(dict.fromkeys(p for p in found if p.is_absolute()))


def shebang_command(head: str) -> str | None:
    """The command a script's `#!` line names (its first word), or None."""
    return next(iter(shebang_words(head.partition("\n")[0])), None)


def _environments(interpreters: Iterable[Path]) -> list[Path]:
    """Each interpreter and what it runs before any of ours: its venv's pyvenv.cfg, bin/ and
    lib/ directories and the files at the top of its site-packages (a .pth there runs at
    every start), and the base installation's standard library and site directories."""
    parts: list[Path] = []
    for interpreter in interpreters:
        parts.append(interpreter)
        venv = interpreter.parent.parent
        if (venv / "pyvenv.cfg").is_file():
            parts += [venv / "pyvenv.cfg", venv / "bin", venv / "lib"]
            parts += _library(sorted((venv / "lib").glob("python3*")))
        real = Path(os.path.realpath(interpreter))
        version = _PYTHON_VERSION.match(real.name)
        if version is not None and real.parent.name == "bin":
            prefix = real.parent.parent
            parts += _library([prefix / "lib" / f"python{version.group(1)}"])
            parts += _library([prefix / "lib" / "python3"])  # Debian's dist-packages
    return list(dict.fromkeys(parts))


def _library(directories: Iterable[Path]) -> list[Path]:
    parts: list[Path] = []
    for directory in directories:
        if not directory.is_dir():
            continue
        parts.append(directory)
        for site in (directory / "site-packages", directory / "dist-packages"):
            if site.is_dir():
                parts += [site, *sorted(site.iterdir())]
    return parts


def targets_problem(paths: Iterable[Path], *, top: Path = TRUST_TOP) -> str | None:
    """Why setup cannot write `paths` safely, or None: a directory another account could
    change (it could plant or swap what root writes there), or one that cannot be written."""
    for directory in dict.fromkeys(p.parent for p in paths):
        found = untrusted(directory, top=top, owners=_owners(directory))
        if found is not None:
            return (
                f"{found}: another account could plant or swap the files root writes there;"
                f" chown root:root {found.path} && chmod go-w {found.path}, then run setup again"
            )
        blocked = unwritable(directory)
        if blocked is not None:
            return f"{blocked}: setup cannot write {directory}; nothing was changed"
    return None


def _owners(directory: Path) -> set[int]:
    """Who may own a target directory: root; the polkit rules directory also polkit's own
    account (Debian and Fedora ship it polkitd:root 0700), which decides authorisations
    anyway."""
    owners = {0}
    if directory == POLKIT_FILE.parent:
        for name in POLKIT_ACCOUNTS:
            with contextlib.suppress(KeyError):
                owners.add(pwd.getpwnam(name).pw_uid)
    return owners


def config_warnings(config: Config, config_path: Path, facts: SystemdFacts) -> list[str]:
    """What setup installs but should tell: an inline webhook anyone can read, units systemd
    does not know, or that systemd could not be asked."""
    warnings = [note for note in (inline_webhook_note(config, config_path),) if note]
    warnings += [alias_note(alias, real) for alias, real in facts.aliases.items()]
    warnings += [
        f"systemd knows no unit {unit} (LoadState=not-found): the gate is installed but"
        f" nothing runs it; check the [[unit]] name in {config_path}"
        for unit in facts.not_found
    ]
    if facts.trouble is not None:
        warnings.append(
            f"cannot ask systemd about the configured units ({facts.trouble}): not checked"
            " whether it knows them, nor which Python their ExecStart= runs"
        )
    return warnings


def inline_webhook_note(config: Config, config_path: Path) -> str | None:
    """What setup and check-config say of a webhook URL inline in a config every account can
    read (anyone on the host could post to the channel); None when there is none."""
    if config.slack.webhook_url is None or not config_path.stat().st_mode & 0o004:
        return None
    return (
        f"{config_path} is readable by every account and holds slack.webhook_url inline:"
        f" anyone on this host can post to the channel; put the URL in {CREDENTIAL_FILE}"
        " (root's, handed to the daemon as a credential) and remove it from the config"
    )


def ungated_note(unit: str) -> str:
    """What check-config (and the daemon) say of a unit systemd runs no gate for."""
    return (
        f"systemd runs no vllm-supervisor gate for {unit} (its loaded ExecCondition= has none: "
        "no drop-in, or a later one such as `systemctl edit`'s emptied ExecCondition=): a "
        "halt stops it but nothing refuses its next start, and no held start is held; run "
        "`vllm-supervisor setup`, and keep ExecCondition= out of other drop-ins"
    )


def alias_note(alias: str, real: str) -> str:
    """What setup and check-config say of a configured name that is an alias."""
    return (
        f"{alias} is an alias of {real}: the supervisor follows, gates and stops {real}"
        f" (its gate drop-in belongs in {real}.d/ and the polkit rule must name {real});"
        f" name {real} in [[unit]] to say what runs"
    )


def main(args: argparse.Namespace) -> int:
    """`setup`: the supervisor's unit, user, drop-ins, polkit rule, catalog, man page and shell
    completions, from the config."""
    path = (args.config or INSTALLED_CONFIG).absolute()
    config = load_config(path) if path.is_file() or not args.uninstall else load_config(None)
    program = args.program or default_program()
    if args.print:
        return print_files(config, config_path=path, program=program, out=sys.stdout)
    if args.uninstall:
        return uninstall(config, purge=args.purge, out=sys.stdout)
    return install(
        config, config_path=path, program=program, start=not args.no_start, out=sys.stdout
    )
