"""The installed package: its own import name, beside PyPI's `supervisor` (supervisord).

The repository folder is `supervisor/`, but `supervisor` is the import name of supervisord,
which vLLM itself pulls in (through model-hosting-container-standards). Installed under one
name, uninstalling either package deleted the other's files. The package now installs as
`vllm_supervisor` and imports itself relatively; these tests build it into a fresh venv next to
supervisord (a wheel `scripts/install-deps` downloaded: no network here) and run both.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / ".cache" / "wheels"


def run(*argv: str | Path, timeout: float = 300) -> str:
    done = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{argv} exited {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


def copy_of_repo(dest: Path) -> Path:
    """The tracked files only (a build writes into its source tree)."""
    files = run("git", "-C", REPO, "ls-files", "-z").split("\0")
    for name in filter(None, files):
        source, target = REPO / name, dest / name
        if name.startswith("tests/"):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():  # supervisor/data/signatures and deploy link into the repo
            target.symlink_to(source.readlink())
        elif source.is_file():
            target.write_bytes(source.read_bytes())
    return dest


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv (seeing this interpreter's dependencies) with supervisord and vllm-supervisor."""
    wheel = sorted(WHEELS.glob("supervisor-*.whl"))
    assert wheel, f"no supervisord wheel in {WHEELS}: run scripts/install-deps"
    root = tmp_path_factory.mktemp("pkg")
    env = root / "venv"
    run(sys.executable, "-m", "venv", "--system-site-packages", env)
    pip = (env / "bin" / "python", "-m", "pip", "-q", "--disable-pip-version-check")
    run(*pip, "install", "--no-index", "--no-deps", wheel[-1])
    source = copy_of_repo(root / "src")
    run(*pip, "install", "--no-deps", "--no-build-isolation", source)
    return env


def where(env: Path, module: str) -> str:
    code = f"import {module}; print({module}.__file__)"
    return run(env / "bin" / "python", "-I", "-c", code).strip()


class TestBesideSupervisord:
    def test_both_run_from_one_venv(self, venv: Path) -> None:
        """Each command runs, each import name is its own package in the venv."""
        assert run(venv / "bin" / "supervisord", "--version").strip().startswith("4.")
        assert run(venv / "bin" / "vllm-supervisor", "--version").startswith("vllm-supervisor")
        assert where(venv, "supervisor").startswith(str(venv))
        assert where(venv, "vllm_supervisor").startswith(str(venv))
        assert "/supervisor/" in where(venv, "supervisor")

    def test_the_native_reader_is_installed_beside_the_package(self, venv: Path) -> None:
        """setup.py links the libsystemd reader program into the installed package, executable,
        and the daemon there picks it."""
        code = (
            "from vllm_supervisor.journal.reader import NATIVE_READER, resolve_source; "
            "print(NATIVE_READER, resolve_source('auto'))"
        )
        path, source = run(venv / "bin" / "python", "-I", "-c", code).split()
        assert path.startswith(str(venv)) and source == "native"
        refused = subprocess.run([path, "--no-such-option"], capture_output=True, text=True)
        assert refused.returncode == 2
        assert "unknown or incomplete option: --no-such-option" in refused.stderr

    def test_removing_one_leaves_the_other_whole(self, venv: Path) -> None:
        """Uninstalling vllm-supervisor does not touch supervisord's files, and back."""
        pip = (venv / "bin" / "python", "-m", "pip", "-q", "--disable-pip-version-check")
        run(*pip, "uninstall", "-y", "vllm-supervisor")
        assert run(venv / "bin" / "supervisord", "--version").strip().startswith("4.")
        run(*pip, "install", "--no-deps", "--no-build-isolation", venv.parent / "src")
        run(*pip, "uninstall", "-y", "supervisor")
        assert run(venv / "bin" / "vllm-supervisor", "--version").startswith("vllm-supervisor")
        assert where(venv, "vllm_supervisor").startswith(str(venv))


def test_the_suite_refuses_the_code_of_another_checkout(tmp_path: Path) -> None:
    """Run in a copy of this checkout, the suite stops before collecting (exit 4) and names
    both places: this interpreter imports vllm_supervisor from here, not from the copy, and
    the copy's tests would otherwise pass or fail on this checkout's code."""
    clone = copy_of_repo(tmp_path / "clone")
    (clone / "tests").mkdir()
    for helper in ("conftest.py", "slack_server.py"):
        (clone / "tests" / helper).write_bytes((REPO / "tests" / helper).read_bytes())
    (clone / "tests" / "test_anything.py").write_text("def test_anything() -> None:\n    pass\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests/test_anything.py"],
        cwd=clone,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    said = done.stdout + done.stderr
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, said
    assert f"imported from {REPO / 'supervisor'}" in said
    assert f"not from this checkout's {clone / 'supervisor'}" in said


def test_every_folder_of_the_package_is_installed() -> None:
    """pyproject's explicit package list (needed for the name mapping) names every folder."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"vllm_supervisor": "supervisor"}
    folders = sorted(
        "vllm_supervisor"
        + "".join(f".{p}" for p in init.parent.relative_to(REPO / "supervisor").parts)
        for init in (REPO / "supervisor").rglob("__init__.py")
    )
    assert sorted(config["packages"]) == folders


def test_the_package_imports_itself_relatively() -> None:
    """No module names `supervisor` absolutely: under that name it would load supervisord."""
    absolute = []
    for path in sorted((REPO / "supervisor").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            absolute += [f"{path}: {n}" for n in names if n.split(".")[0] == "supervisor"]
    assert absolute == []


def test_the_deploy_files_setup_installs_are_in_the_package(venv: Path) -> None:
    """`setup` runs from a pip install: its templates ship inside the package."""
    code = (
        "from vllm_supervisor.commands import setup; from pathlib import Path;"
        "print(sorted(str(p.relative_to(setup.DEPLOY)) for p in setup.DEPLOY.rglob('*.*')))"
    )
    listed = run(venv / "bin" / "python", "-I", "-c", code)
    count = (
        "from vllm_supervisor.classify.signatures import load_signature_table as load;"
        "print(len(load().signatures))"
    )
    assert int(run(venv / "bin" / "python", "-I", "-c", count)) > 100  # the shipped table too
    for name in (
        "systemd/vllm-supervisor.service",
        "systemd/vllm.service.d/10-vllm-supervisor.conf",
        "polkit/50-vllm-supervisor.rules",
        "sysusers.d/vllm-supervisor.conf",
        "catalog/vllm-supervisor.catalog",
    ):
        assert name in listed
