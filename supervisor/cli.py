"""The `vllm-supervisor` command line: argument parsing, logging set-up, signals, exit codes.

Exit codes: 0 ok; 1 a command's own "no" (gate: quarantined; preflight: a check failed);
2 bad configuration or input, reported as one line without a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from . import __version__
from .config import (
    DEFAULT_RUNTIME_DIR,
    DEFAULT_STATE_DIR,
    SUPERVISOR_UNIT,
    Config,
    load_config,
    parse_listen,
    with_units,
)
from .errors import SupervisorError
from .story import NO_ROOT_CAUSE, shown, told
from .telemetry.logs import configure_logging
from .util.text import for_terminal, visible

EXIT_USAGE = 2
UNEXPECTED = "unexpected error, please report it with the command line"
CONFIG_ENV = "VLLM_SUPERVISOR_CONFIG"
INSTALLED_CONFIG = Path("/etc/vllm-supervisor/supervisor.toml")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or the one-line usage error
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    configure_logging(level=os.environ.get("VLLM_SUPERVISOR_LOG_LEVEL", "info"))
    try:
        return int(args.handler(args))
    except SupervisorError as exc:
        print(f"vllm-supervisor: {visible(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # the last net: one line, never a traceback
        print(
            f"vllm-supervisor: {args.command}: {UNEXPECTED}: {_shown(repr(exc))}", file=sys.stderr
        )
        return EXIT_USAGE


class _Parser(argparse.ArgumentParser):
    """argparse with its mistakes said in one line (`vllm-supervisor: status: ...`), exit 2."""

    def error(self, message: str) -> NoReturn:
        where = self.prog.removeprefix("vllm-supervisor").strip()
        self.exit(EXIT_USAGE, f"vllm-supervisor: {where + ': ' if where else ''}{message}\n")


def port_number(text: str) -> int:
    """A TCP port for `--port`: 1..65535."""
    if not (text.isascii() and text.isdigit() and 1 <= int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (1..65535)")
    return int(text)


CONFIG_HELP = (
    f"the TOML config (default: ${CONFIG_ENV}, else {INSTALLED_CONFIG} when it exists, else"
    " the built-in defaults)"
)
STATE_DIR_HELP = (
    "the directory of the state database (default: the config's state.state_dir, else"
    f" $STATE_DIRECTORY, else {DEFAULT_STATE_DIR})"
)
RUNTIME_DIR_HELP = (
    "the directory of the quarantine records and the gates' socket (default: the config's"
    f" state.runtime_dir, else $RUNTIME_DIRECTORY, else {DEFAULT_RUNTIME_DIR})"
)
FORMAT_HELP = "text for a person (default), json for a program"
UNIT_HELP = "the systemd unit, e.g. vllm.service (an alias is taken for its unit)"


def build_parser() -> argparse.ArgumentParser:
    """All subcommands and their flags (the CLI contract of docs/DESIGN.md §4)."""
    parser = _Parser(
        prog="vllm-supervisor",
        description="Halt systemd restart loops of LLM inference servers on deterministic crashes.",
        epilog="Exit status: 0 ok; 1 a command's own no (gate: quarantined; preflight: a check"
        " failed; status: a unit is halted); 2 a bad config or input, said in one line; 3"
        " (status) the daemon is down or unhealthy. `vllm-supervisor COMMAND --help` shows a"
        " command's options; man vllm-supervisor shows them all.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="follow the journal and act on crashes (the daemon)")
    _add_config_flags(run)
    run.add_argument("--dry-run", action="store_true", help="decide and report, never stop a unit")
    run.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve /metrics and /healthz here (default: the config's metrics.listen,"
        " 127.0.0.1:9464)",
    )
    run.set_defaults(handler=cmd_run)

    triage = sub.add_parser("triage", help="classify every failed invocation in a saved journal")
    triage.add_argument(
        "source",
        nargs="?",
        default="-",
        help="a journal directory or file, journalctl -o export or -o json output, or pasted"
        " text; - (the default) reads standard input",
    )
    triage.add_argument(
        "--unit",
        action="append",
        default=[],
        metavar="UNIT",
        help="only this unit (repeat for more)",
    )
    triage.add_argument("--config", type=Path, metavar="PATH", help=CONFIG_HELP)
    _add_format(triage)
    triage.set_defaults(handler=cmd_triage)

    check = sub.add_parser("check-config", help="validate a config and its signature table")
    check.add_argument(
        "path",
        nargs="?",
        type=Path,
        help=f"the config to check (default: ${CONFIG_ENV}, else {INSTALLED_CONFIG})",
    )
    check.set_defaults(handler=cmd_check_config)

    signatures = sub.add_parser("signatures", help="inspect the signature table")
    signatures.add_argument("--config", type=Path, metavar="PATH", help=CONFIG_HELP)
    sig_sub = signatures.add_subparsers(dest="signatures_command", required=True)
    sig_sub.add_parser("list", help="every signature").set_defaults(handler=cmd_signatures_list)
    test = sig_sub.add_parser("test", help="which signature matches which line of FILE, and why")
    test.add_argument("file", help="a log file, or - for standard input")
    test.set_defaults(handler=cmd_signatures_test)

    history = sub.add_parser("history", help="every invocation the daemon classified")
    history.add_argument("--unit", metavar="UNIT", help="only this unit's invocations")
    _add_format(history)
    history.add_argument("--config", type=Path, metavar="PATH", help=CONFIG_HELP)
    history.add_argument("--state-dir", type=Path, metavar="DIR", help=STATE_DIR_HELP)
    history.set_defaults(handler=cmd_history)

    for name, handler, text in (
        ("gate", cmd_gate, "ExecCondition check: exit 1 while UNIT is quarantined"),
        ("release", cmd_release, "remove UNIT's quarantine so it may start again"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("unit", help=UNIT_HELP)
        cmd.add_argument("--config", type=Path, metavar="PATH", help=CONFIG_HELP)
        _add_dir_flags(cmd)
        cmd.set_defaults(handler=handler)
        if name == "gate":
            cmd.add_argument(
                "--supervisor-unit",
                default=SUPERVISOR_UNIT,
                help="the supervisor's own unit, waited for while systemd brings it back",
            )

    status = sub.add_parser("status", help="what is halted, why, and is the supervisor healthy")
    status.add_argument("unit", nargs="*", help="these units (default: every configured one)")
    status.add_argument("--config", type=Path, metavar="PATH", help=CONFIG_HELP)
    _add_dir_flags(status)
    _add_format(status)
    status.set_defaults(handler=cmd_status)

    preflight = sub.add_parser("preflight", help="check a unit's environment before it starts")
    preflight.add_argument("unit", help=UNIT_HELP)
    preflight.add_argument("--config", type=Path, metavar="PATH", help=CONFIG_HELP)
    preflight.add_argument(
        "--python",
        type=Path,
        metavar="PATH",
        help="the served unit's interpreter (default: the unit's python in the config)",
    )
    preflight.add_argument(
        "--port",
        type=port_number,
        metavar="PORT",
        help="the port the server binds, checked free (default: the unit's port in the config)",
    )
    _add_dir_flags(preflight)
    _add_format(preflight)
    preflight.set_defaults(handler=cmd_preflight)

    setup = sub.add_parser("setup", help="install the supervisor under systemd from its config")
    setup.add_argument(
        "--config",
        type=Path,
        metavar="PATH",
        help=f"the config to install from (default: {INSTALLED_CONFIG})",
    )
    setup.add_argument(
        "--program", metavar="PATH", help="the vllm-supervisor the units run (default: on PATH)"
    )
    setup.add_argument("--print", action="store_true", help="show the files, change nothing")
    setup.add_argument("--uninstall", action="store_true", help="remove what setup installed")
    setup.add_argument("--purge", action="store_true", help="with --uninstall: state and user too")
    setup.add_argument("--no-start", action="store_true", help="install, do not start the daemon")
    setup.set_defaults(handler=cmd_setup)

    demo = sub.add_parser("demo", help="replay the bundled crash loop into a real journal")
    demo.add_argument(
        "--directory", type=Path, metavar="DIR", help="where to write the demo journal"
    )
    demo.add_argument("--keep", action="store_true", help="keep the demo files")
    demo.set_defaults(handler=cmd_demo)
    return parser


def _add_config_flags(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--config", type=Path, metavar="PATH", help=CONFIG_HELP)
    cmd.add_argument(
        "--unit",
        action="append",
        default=[],
        metavar="UNIT",
        help="supervise this unit too, with default settings (repeat for more)",
    )
    cmd.add_argument(
        "--directory", type=Path, metavar="DIR", help="follow a journal directory (journalctl -D)"
    )
    _add_dir_flags(cmd)


def _add_dir_flags(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--runtime-dir", type=Path, metavar="DIR", help=RUNTIME_DIR_HELP)
    cmd.add_argument("--state-dir", type=Path, metavar="DIR", help=STATE_DIR_HELP)


def _add_format(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--format", choices=("text", "json"), default="text", help=FORMAT_HELP)


def config_path(args: argparse.Namespace) -> Path | None:
    """`--config`, else $VLLM_SUPERVISOR_CONFIG, else the installed config when it exists.

    The gate runs from the served unit with no flags: it must find the daemon's directories
    from the same file the daemon reads, or a non-default `state.runtime_dir` would let every
    start through.
    """
    given = getattr(args, "config", None)
    if given is not None:
        return Path(given)
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env)
    return INSTALLED_CONFIG if INSTALLED_CONFIG.is_file() else None


def resolve_config(args: argparse.Namespace) -> Config:
    """The config file plus the one-run overrides from flags and systemd's environment."""
    config = load_config(config_path(args))
    state = config.state
    runtime_dir = getattr(args, "runtime_dir", None) or _from_env(
        "RUNTIME_DIRECTORY", state.runtime_dir, DEFAULT_RUNTIME_DIR
    )
    state_dir = getattr(args, "state_dir", None) or _from_env(
        "STATE_DIRECTORY", state.state_dir, DEFAULT_STATE_DIR
    )
    state = dataclasses.replace(state, runtime_dir=runtime_dir, state_dir=state_dir)
    journal = config.journal
    if getattr(args, "directory", None):
        journal = dataclasses.replace(journal, directory=args.directory)
    metrics = config.metrics
    if getattr(args, "metrics_listen", None):
        parse_listen(args.metrics_listen)
        metrics = dataclasses.replace(metrics, listen=args.metrics_listen)
    config = dataclasses.replace(
        config,
        state=state,
        journal=journal,
        metrics=metrics,
        dry_run=config.dry_run or bool(getattr(args, "dry_run", False)),
    )
    # `run --unit` adds units; for gate/release/preflight `unit` is the one unit they act on.
    extra = args.unit if isinstance(getattr(args, "unit", None), list) else []
    return with_units(config, extra)


def _from_env(variable: str, configured: Path, default: Path) -> Path:
    # systemd's RuntimeDirectory=/StateDirectory= set these; they win over a default, not
    # over a value an operator wrote into the config.
    value = os.environ.get(variable)
    if configured == default and value:
        return Path(value.split(":")[0])
    return configured


def cmd_run(args: argparse.Namespace) -> int:
    """`run`: the daemon, until SIGTERM/SIGINT; SIGHUP reloads the config and its table."""
    from .app import run_daemon

    config = resolve_config(args)
    if not config.units:
        print(
            "vllm-supervisor: no unit to supervise: pass --unit U or list [[unit]] in the config",
            file=sys.stderr,
        )
        return EXIT_USAGE

    async def serve() -> None:
        stop, reload = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGHUP, reload.set)
        await run_daemon(config, stop, reload, reload_config=lambda: resolve_config(args))

    asyncio.run(serve())
    return 0


def cmd_triage(args: argparse.Namespace) -> int:
    """`triage`: classify a saved journal with the daemon's own pipeline."""
    from .classify.table import load_table
    from .commands.triage import triage

    config = with_units(load_config(config_path(args)), args.unit)
    return triage(args.source, config=config, table=load_table(config), output_format=args.format)


def cmd_check_config(args: argparse.Namespace) -> int:
    """`check-config`: load the config, its signature table and the engine files, report what
    was found (as ExecReload=, a file the reload would refuse fails it here)."""
    from .classify.table import load_table
    from .config import check_webhook
    from .engines.profiles import load_engines

    config = load_config(args.path or config_path(argparse.Namespace()))
    table = load_table(config)
    engines = load_engines()
    # As the daemon's ExecReload= it runs as the daemon's user: what that user may not read
    # (the webhook's credential file, a unit directory) is a warning, not a refused reload.
    try:
        check_webhook(config.slack)
    except OSError as exc:
        print(f"warning: the webhook URL was not checked: {exc.strerror}", file=sys.stderr)
    units = ", ".join(u.name for u in config.units) or "none (pass --unit to run)"
    print(
        f"config ok: units: {units}; {len(table.signatures)} signatures; engines: "
        f"{', '.join(engines.ids)}"
    )
    from .commands.setup import alias_note, ask_systemd, missing_drop_ins

    # Where systemd cannot be asked (no bus here), names are checked as configured.
    aliases = ask_systemd([u.name for u in config.units]).aliases
    for alias, real in aliases.items():
        print(f"warning: {alias_note(alias, real)}", file=sys.stderr)
    try:
        missing = missing_drop_ins(config, real_names=aliases)
    except OSError as exc:
        print(f"warning: the gate drop-ins were not checked: {exc.strerror}", file=sys.stderr)
        missing = []
    for unit in missing:
        print(
            f"warning: {unit} has no gate drop-in ({unit}.d/10-vllm-supervisor.conf): a halt "
            "stops it but nothing refuses its next start; run `vllm-supervisor setup`",
            file=sys.stderr,
        )
    return 0


def cmd_signatures_list(args: argparse.Namespace) -> int:
    """`signatures list`: one line per signature."""
    from .classify.table import load_table

    table = load_table(load_config(config_path(args)))
    for sig in table.signatures:
        line = f"{sig.id:40} {sig.severity.value:9} {sig.kind:7} {sig.domain:12} {sig.title}"
        print(for_terminal(line))
    return 0


def cmd_signatures_test(args: argparse.Namespace) -> int:
    """`signatures test FILE`: the verdict, then which signatures matched which line and why."""
    from .classify.table import load_table
    from .commands.sigtest import signatures_test

    table = load_table(load_config(config_path(args)))
    return signatures_test(args.file, table)


def cmd_history(args: argparse.Namespace) -> int:
    """`history`: what the daemon classified, from its state database."""
    from .store import Store

    config = resolve_config(args)
    path = config.state.state_dir
    store = Store.read_only(path)
    try:
        items = store.history(args.unit)
    finally:
        store.close()
    if args.format == "json":
        print(json.dumps({"invocations": items}, indent=2))
        return 0
    if not items:
        print(for_terminal(f"no classified invocation in {path}"))
    for item in items:
        print(for_terminal(_history_text(item)), end="")
    return 0


def _history_text(item: dict[str, Any]) -> str:
    """One recorded invocation for a person; every recorded value is shown `visible`."""
    verdict, decision = _mapping(item.get("verdict")), _mapping(item.get("decision"))
    text = (
        f"{_shown(item.get('time'))}  {_shown(item.get('unit'))}  "
        f"{_shown(item.get('invocation_id') or '-')}  {_shown(verdict.get('severity')):9} "
        f"{_shown(verdict.get('signature') or '-'):32} "
        f"notified={item.get('notified')}{'  engine hung' if item.get('hung') else ''}\n"
        f"    {_shown(told(_text(decision.get('action')), _text(item.get('taken'))))}\n"
        f"    {_shown(verdict.get('root_cause') or NO_ROOT_CAUSE)}\n"
    )
    drift = item.get("drift")
    if isinstance(drift, list) and drift:
        text += f"    changed since the last good start: {_shown('; '.join(map(str, drift)))}\n"
    return text


def _shown(value: object) -> str:
    return visible(shown(value))


def _text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def _mapping(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def cmd_gate(args: argparse.Namespace) -> int:
    """`gate UNIT`: the ExecCondition check. It runs in the served unit, whose environment
    (RUNTIME_DIRECTORY) is not the daemon's: the directories come from the config, and the
    drop-in's `--runtime-dir`/`--state-dir` add places a record may be in, so one is found even
    when the config does not load. That must not skip every start (exit 2 is "condition
    failed" to systemd): the gate then says so in one line and goes on."""
    from .actions.quarantine import DEFAULT_DIRS
    from .commands.gate import gate_main

    try:
        config = load_config(config_path(args))
    except SupervisorError as exc:
        print(f"{args.unit}: the supervisor's config does not load ({exc})", file=sys.stderr)
        config = Config()
    state = config.state
    runtime_dir = state.runtime_dir
    if runtime_dir == DEFAULT_RUNTIME_DIR and args.runtime_dir is not None:
        runtime_dir = args.runtime_dir  # where the daemon's socket is, for a test's daemon
    named = tuple(d for d in (args.runtime_dir, args.state_dir) if d is not None)
    return gate_main(
        args.unit,
        runtime_dir,
        state.state_dir,
        wait_s=config.gate.wait_s,
        defaults=(*named, *DEFAULT_DIRS),
        supervisor_wait_s=config.gate.supervisor_restart_wait_s,
        supervisor_unit=args.supervisor_unit,
    )


def cmd_release(args: argparse.Namespace) -> int:
    """`release UNIT`: lift a halt."""
    from .actions.unitnames import real_name
    from .commands.gate import release_main

    config = resolve_config(args)
    unit = real_name(args.unit)  # the record is under the unit's real name, not an alias
    if unit != args.unit:
        print(f"{args.unit} is an alias of {unit}", file=sys.stderr)
    return release_main(unit, config.state.runtime_dir, config.state.state_dir)


def cmd_status(args: argparse.Namespace) -> int:
    """`status [UNIT...]`: halted units, why and since when, and the daemon's health."""
    from .actions.unitnames import real_name
    from .commands.status import status_main

    config = resolve_config(args)
    units = [real_name(unit) for unit in args.unit]
    return status_main(config, units, output_format=args.format, out=sys.stdout)


def cmd_preflight(args: argparse.Namespace) -> int:
    """`preflight UNIT`: catch a crash before the model loads."""
    from .classify.table import load_table
    from .commands.preflight import preflight_main

    config = resolve_config(args)
    unit = config.unit(args.unit)
    python = args.python or (Path(unit.python) if unit.python else None)
    try:
        table = load_table(config)
    except SupervisorError as exc:
        # A broken table must not fail the served unit's start (preflight may run as its
        # ExecStartPre=): say so, and check with the built-in families alone.
        print(f"vllm-supervisor: preflight without the signature table: {exc}", file=sys.stderr)
        table = None
    return preflight_main(
        args.unit,
        python=python,
        port=args.port if args.port is not None else unit.port,
        runtime_dir=config.state.runtime_dir,
        state_dir=config.state.state_dir,
        output_format=args.format,
        table=table,
    )


def cmd_setup(args: argparse.Namespace) -> int:
    """`setup`: the supervisor's unit, user, drop-ins, polkit rule, catalog, man page and shell
    completions, from the config."""
    from .commands import setup

    path = (args.config or INSTALLED_CONFIG).absolute()
    config = load_config(path) if path.is_file() or not args.uninstall else load_config(None)
    program = args.program or setup.default_program()
    if args.print:
        return setup.print_files(config, config_path=path, program=program, out=sys.stdout)
    if args.uninstall:
        return setup.uninstall(config, purge=args.purge, out=sys.stdout)
    return setup.install(
        config, config_path=path, program=program, start=not args.no_start, out=sys.stdout
    )


def cmd_demo(args: argparse.Namespace) -> int:
    """`demo`: write the seed crash loop into a real journal and run the daemon on it."""
    from .commands.demo import run_demo

    # The demo prints its own sections; between them only the daemon's warnings (a halt, a
    # hung engine), as readable lines, not JSON.
    configure_logging(level=os.environ.get("VLLM_SUPERVISOR_LOG_LEVEL", "warning"), json=False)
    return run_demo(directory=args.directory, keep=args.keep)
