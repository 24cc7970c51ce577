"""The man page and the bash and zsh completions, generated from the CLI's own parser.

`python -m vllm_supervisor.cli_docs deploy/cli` writes them (argparse-manpage and shtab, from
the `dev` extra) in the layout of share/; the wheel installs them into its prefix's share/
(pyproject's data-files), and tests/test_cli_docs.py fails when a file differs from what the
parser gives now, so help text is written once, in cli.py, and the three cannot drift from it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from . import __version__
from .cli import build_parser

# Where each goes under share/ (deploy/cli/ mirrors it; the wheel installs them there).
MAN_PAGE = "man/man1/vllm-supervisor.1"
BASH = "bash-completion/completions/vllm-supervisor"
ZSH = "zsh/site-functions/_vllm-supervisor"
FILES = (MAN_PAGE, BASH, ZSH)
# Fixed, so the page is the same on every build (argparse-manpage would put today's date).
MAN_DATE = "2026-12"
WIDTH = "80"  # argparse wraps help to $COLUMNS: fixed, so the output is the same everywhere


@contextmanager
def _columns() -> Iterator[None]:
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def render() -> dict[str, str]:
    """Each file's name and text, from the parser as it is now."""
    import shtab
    from argparse_manpage.manpage import Manpage  # type: ignore[import-untyped]

    with _columns():
        page = str(
            Manpage(
                build_parser(),
                _data={
                    "project_name": "vllm-supervisor",
                    # The series only: the page must not change with each commit's build.
                    "version": ".".join(__version__.split(".")[:2]),
                    "manual_title": "vllm-supervisor manual",
                    "date": MAN_DATE,
                    "description": "halt systemd restart loops of LLM inference servers on"
                    " deterministic crashes",
                },
            )
        )
        return {
            MAN_PAGE: page.rstrip("\n") + "\n" + _more_sections(),
            # `shell` names the completion's dialect; nothing is run.
            BASH: shtab.complete(build_parser(), shell="bash"),  # noqa: S604
            ZSH: shtab.complete(build_parser(), shell="zsh"),  # noqa: S604
        }


# What a man page has beyond the options and the epilog (argparse-manpage's COMMENTS).
FILES_SECTION = (
    ("/etc/vllm-supervisor/supervisor.toml", "the config (the units, the sinks, the paths)"),
    ("/etc/vllm-supervisor/slack-webhook", "the Slack webhook URL, handed over as a credential"),
    ("/run/vllm-supervisor/quarantine/", "quarantine records: one per halted unit"),
    ("/var/lib/vllm-supervisor/", "the state database: cursor, history, outbox"),
)
SEE_ALSO = "systemctl(1), journalctl(1), systemd.service(5), systemd.exec(5)"


def _roff(text: str) -> str:
    """Plain text as roff: backslashes and hyphens escaped, no line taken for a request."""
    return text.replace("\\", "\\e").replace("-", "\\-").replace("\n.", "\n\\&.")


def _more_sections() -> str:
    lines = [".SH FILES"]
    for path, what in FILES_SECTION:
        lines += [".TP", f"\\fI{_roff(path)}\\fR", _roff(what)]
    lines += ['.SH "SEE ALSO"', _roff(SEE_ALSO)]
    return "\n".join(lines) + "\n"


def write(directory: Path) -> list[Path]:
    """Write every file into `directory`; the paths written."""
    written = []
    for name, text in render().items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str]) -> int:
    """`python -m vllm_supervisor.cli_docs DIRECTORY`."""
    if len(argv) != 1:
        sys.stderr.write("usage: python -m vllm_supervisor.cli_docs DIRECTORY\n")
        return 2
    for path in write(Path(argv[0])):
        sys.stdout.write(f"wrote {path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
