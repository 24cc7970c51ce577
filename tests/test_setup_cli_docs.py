"""`vllm-supervisor setup` installs the man page and the bash and zsh completions where `man`,
bash-completion and zsh look without being told (/usr/local/share), and `--uninstall` removes
them. The wheel puts them into its venv's share/, which none of the three searches for a venv
under /opt: before, deploy/README.md asked for three hand-made symlinks.

setup runs as root into a fake / (the fixture of test_setup_safety.py).
"""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import test_setup_safety
from test_cli_docs import groff_warnings
from test_setup_safety import Host

from vllm_supervisor import cli_docs
from vllm_supervisor.commands import setup
from vllm_supervisor.config import load_config

REPO_DOCS = Path(__file__).resolve().parent.parent / "deploy" / "cli"
MARKER = setup.MARKER.removeprefix("# ")
host = test_setup_safety.host  # the fake / setup installs into


def installed(host: Host, name: str) -> Path:
    return host.target("SHARE_DIR") / name


def test_setup_installs_each_generated_file_and_no_other() -> None:
    """What setup installs is what cli_docs generates (deploy/cli/, in share/'s layout)."""
    assert sorted(setup.CLI_DOCS) == sorted(cli_docs.FILES)


def test_the_bash_completion_setup_installed_completes(host: Host) -> None:
    """bash-completion loads completions/vllm-supervisor when the command is completed: the
    installed file, sourced, offers the commands and an option's choices."""
    host.install()
    script = (
        f"source {installed(host, cli_docs.BASH)}\n"
        "COMP_WORDS=(vllm-supervisor status --format ''); COMP_CWORD=3\n"
        "_shtab_vllm_supervisor vllm-supervisor\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    done = subprocess.run(
        ["bash", "--norc", "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert sorted(done.stdout.split()) == ["json", "text"]


def test_the_zsh_completion_keeps_compdef_first(host: Host) -> None:
    """compinit reads only the first line for `#compdef`: setup's own mark comes second."""
    host.install()
    lines = installed(host, cli_docs.ZSH).read_text(encoding="utf-8").splitlines()
    assert lines[0] == "#compdef vllm-supervisor"
    assert MARKER in lines[1]


def test_the_installed_man_page_renders_cleanly(host: Host) -> None:
    """groff formats the installed page (setup's mark is a roff comment) without a warning,
    and it is the generated page."""
    host.install()
    page = installed(host, cli_docs.MAN_PAGE).read_text(encoding="utf-8")
    assert page.splitlines()[0] == f'.\\" {MARKER}'
    assert page.partition("\n")[2] == (REPO_DOCS / cli_docs.MAN_PAGE).read_text(encoding="utf-8")
    assert groff_warnings(page) == ""


def test_uninstall_removes_them(host: Host) -> None:
    """`setup --uninstall` removes the three files it wrote."""
    host.install()
    assert all(installed(host, name).is_file() for name in setup.CLI_DOCS)
    setup.uninstall(load_config(host.config), out=io.StringIO(), run=host.run)
    assert [name for name in setup.CLI_DOCS if installed(host, name).exists()] == []


def test_a_prefix_whose_share_is_that_directory_already_has_them(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A system-wide install into /usr/local put them there itself (the wheel's data files):
    setup neither refuses those files as not its own nor writes them again."""
    share = host.target("SHARE_DIR")
    monkeypatch.setattr(sys, "prefix", str(share.parent))
    for name in setup.CLI_DOCS:
        (share / name).parent.mkdir(parents=True, exist_ok=True)
        (share / name).write_text("from the wheel\n")
    out = host.install()
    assert all((share / name).read_text() == "from the wheel\n" for name in setup.CLI_DOCS)
    assert str(share) not in out
