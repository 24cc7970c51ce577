"""The command line documents itself: every option and command has help text, and the man page
and the bash and zsh completions in deploy/cli/ are the ones the parser generates now (shtab,
argparse-manpage), so they cannot drift from the options.

Was: most options had no `--help` text; there was no man page and no completion.
"""

from __future__ import annotations

import argparse
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_supervisor import cli_docs
from vllm_supervisor.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "deploy" / "cli"


def parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("vllm-supervisor",)
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """The parser and every subcommand's, with the words that reach it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


def test_every_option_argument_and_command_has_help() -> None:
    """`--help` explains every option and argument of every command, and lists each command
    with a line of its own."""
    missing = []
    for path, parser in parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                helped = {choice.dest for choice in action._choices_actions if choice.help}
                missing += [f"{' '.join(path)} {n}" for n in action.choices if n not in helped]
            elif not action.help or action.help == argparse.SUPPRESS:
                names = "/".join(action.option_strings) or action.dest
                missing.append(f"{' '.join(path)} {names}")
    assert missing == []


@pytest.mark.parametrize("name", sorted(cli_docs.FILES))
def test_the_generated_files_are_current(name: str) -> None:
    """deploy/cli/NAME is what the parser generates now; regenerate with
    `python -m vllm_supervisor.cli_docs deploy/cli`."""
    assert (DOCS / name).read_text(encoding="utf-8") == cli_docs.render()[name], (
        f"deploy/cli/{name} is stale: run python -m vllm_supervisor.cli_docs deploy/cli"
    )


def test_the_man_page_renders_cleanly_and_names_every_option() -> None:
    """groff formats the page with no warning, and the page shows each option of each
    command with its help."""
    page = (DOCS / cli_docs.MAN_PAGE).read_text(encoding="utf-8")
    assert groff_warnings(page) == ""
    text = subprocess.run(
        ["groff", "-man", "-Tutf8", "-P-cbou"],
        input=page,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    flat = " ".join(text.replace("\u2010", "-").split())
    for path, parser in parsers(build_parser()):
        for action in parser._actions:
            for option in action.option_strings:
                assert option in flat, f"{' '.join(path)} {option}"


def complete(words: list[str]) -> list[str]:
    """What the bash completion offers for `words` (the last one being typed)."""
    script = (
        f"source {DOCS / cli_docs.BASH}\n"
        f"COMP_WORDS=({' '.join(words)}); COMP_CWORD={len(words) - 1}\n"
        f'COMP_LINE="{" ".join(words)}"; COMP_POINT=${{#COMP_LINE}}\n'
        "_shtab_vllm_supervisor vllm-supervisor\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(
        ["bash", "--norc", "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    return done.stdout.split()


def test_bash_completes_commands_options_and_choices() -> None:
    """Sourced into bash, the completion offers the commands, a command's options and an
    option's choices."""
    assert complete(["vllm-supervisor", "sta"]) == ["status"]
    assert "--metrics-listen" in complete(["vllm-supervisor", "run", "--"])
    assert sorted(complete(["vllm-supervisor", "status", "--format", ""])) == ["json", "text"]


def test_the_zsh_completion_is_an_autoloadable_function_of_every_command() -> None:
    """The zsh file is found by compinit (`#compdef vllm-supervisor` first) and knows every
    command and option."""
    text = (DOCS / cli_docs.ZSH).read_text(encoding="utf-8")
    assert text.startswith("#compdef vllm-supervisor\n")
    for path, parser in parsers(build_parser()):
        assert path[-1] in text
        for action in parser._actions:
            assert all(option in text for option in action.option_strings), path


def groff_warnings(page: str) -> str:
    """What groff says formatting `page` with every warning on ("" when it is clean)."""
    done = subprocess.run(
        ["groff", "-man", "-Tutf8", "-ww", "-z"],
        input=page,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    return done.stderr if done.returncode == 0 else f"exit {done.returncode}: {done.stderr}"
