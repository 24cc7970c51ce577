"""The `vllm-supervisor` command line: argument parsing, logging set-up, exit codes; each
command is its module of `commands/` (`main(args)`), imported when it runs.

Exit codes: 0 ok; 1 a command's own "no" (gate: quarantined; preflight: a check failed);
2 bad configuration or input, reported as one line without a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from . import __version__
from .commands.options import CONFIG_ENV, EXIT_USAGE, INSTALLED_CONFIG
from .config import DEFAULT_RUNTIME_DIR, DEFAULT_STATE_DIR, SUPERVISOR_UNIT
from .errors import SupervisorError
from .story import shown
from .telemetry.logs import configure_logging
from .util.text import visible

UNEXPECTED = "unexpected error, please report it with the command line"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or the one-line usage error
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    configure_logging(level=os.environ.get("VLLM_SUPERVISOR_LOG_LEVEL", "info"))
    try:
        return dispatch(args)
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


def dispatch(args: argparse.Namespace) -> int:
    """Run the parsed command: `main(args)` of its module in `commands/`."""
    command = importlib.import_module(f"{__package__}.commands.{args.handler}")
    return int(command.main(args))


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
    run.set_defaults(handler="run")

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
    triage.set_defaults(handler="triage")

    check = sub.add_parser("check-config", help="validate a config and its signature table")
    check.add_argument(
        "path",
        nargs="?",
        type=Path,
        help=f"the config to check (default: ${CONFIG_ENV}, else {INSTALLED_CONFIG})",
    )
    check.set_defaults(handler="check_config")

    signatures = sub.add_parser("signatures", help="inspect the signature table")
    signatures.add_argument("--config", type=Path, metavar="PATH", help=CONFIG_HELP)
    sig_sub = signatures.add_subparsers(dest="signatures_command", required=True)
    sig_sub.add_parser("list", help="every signature").set_defaults(handler="signatures")
    test = sig_sub.add_parser("test", help="which signature matches which line of FILE, and why")
    test.add_argument("file", help="a log file, or - for standard input")
    test.set_defaults(handler="signatures")
    propose = sig_sub.add_parser(
        "propose", help="a signature written from a recorded crash no signature knows"
    )
    propose.add_argument("unit", help="the unit whose crash it is")
    propose.add_argument(
        "invocation", nargs="?", help="its invocation id (default: the unit's last unknown crash)"
    )
    propose.add_argument(
        "--write",
        nargs="?",
        const="",
        metavar="FILE",
        help="add it to FILE (default: signatures.d/proposed.toml beside the config) once the "
        "table loads with it; reload the daemon to apply it",
    )
    propose.add_argument("--state-dir", type=Path, metavar="DIR", help=STATE_DIR_HELP)
    propose.set_defaults(handler="propose")

    history = sub.add_parser("history", help="every invocation the daemon classified")
    history.add_argument("--unit", metavar="UNIT", help="only this unit's invocations")
    _add_format(history)
    history.add_argument("--config", type=Path, metavar="PATH", help=CONFIG_HELP)
    history.add_argument("--state-dir", type=Path, metavar="DIR", help=STATE_DIR_HELP)
    history.set_defaults(handler="history")

    for name, text in (
        ("gate", "ExecCondition check: exit 1 while UNIT is quarantined"),
        ("release", "remove UNIT's quarantine so it may start again"),
        ("recheck", "start UNIT once the cause its halt names is gone (run by its timer)"),
    ):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("unit", help=UNIT_HELP)
        cmd.add_argument("--config", type=Path, metavar="PATH", help=CONFIG_HELP)
        _add_dir_flags(cmd)
        cmd.set_defaults(handler=name)
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
    status.set_defaults(handler="status")

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
    preflight.set_defaults(handler="preflight")

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
    setup.set_defaults(handler="setup")

    demo = sub.add_parser("demo", help="replay the bundled crash loop into a real journal")
    demo.add_argument(
        "--directory", type=Path, metavar="DIR", help="where to write the demo journal"
    )
    demo.add_argument("--keep", action="store_true", help="keep the demo files")
    demo.set_defaults(handler="demo")
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


def _shown(value: object) -> str:
    return visible(shown(value))
