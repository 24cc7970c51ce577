"""The package as built and installed: `python -m build` gives an sdist and a wheel; the wheel
installs with its dependencies from wheels alone, under its own import name, beside PyPI's
`supervisor` (supervisord).

The repository folder is `supervisor/`, but `supervisor` is the import name of supervisord,
which vLLM itself pulls in (through model-hosting-container-standards). Installed under one
name, uninstalling either package deleted the other's files. The package installs as
`vllm_supervisor` and imports itself relatively; these tests install the wheel built from this
checkout into fresh venvs next to supervisord (wheels `scripts/install-deps` keeps: no index
here) and run both. tests/e2e/test_setup_e2e.py deploys the same wheel under systemd 252.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaged import Built, build, install, tracked_copy, wheelhouse

from vllm_supervisor.commands.setup import CLI_DOCS

REPO = Path(__file__).resolve().parent.parent
READER = "vllm_supervisor/journal/vllm-supervisor-journal-reader"


def run(*argv: str | Path, timeout: float = 300) -> str:
    done = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{argv} exited {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout


def supervisord() -> Path:
    """PyPI's supervisord wheel, from the wheelhouse."""
    found = sorted(wheelhouse().glob("supervisor-*.whl"))
    assert found, f"no supervisord wheel in {wheelhouse()}: run scripts/install-deps"
    return found[-1]


@pytest.fixture(scope="module")
def venv(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with supervisord and the built wheel, both from wheels only."""
    env = tmp_path_factory.mktemp("pkg") / "venv"
    install(env, supervisord(), built.wheel)
    return env


def where(env: Path, module: str) -> str:
    code = f"import {module}; print({module}.__file__)"
    return run(env / "bin" / "python", "-I", "-c", code).strip()


class TestBuild:
    def test_the_sdist_holds_what_the_wheel_is_built_from(self, built: Built) -> None:
        """The wheel is built from the sdist (`python -m build`), so the sdist carries the
        sources of both native parts, the build files and the data behind the symlinks."""
        with tarfile.open(built.sdist) as sdist:
            names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
        for name in (
            "pyproject.toml",
            "setup.py",
            "supervisor/journal/journal_reader.c",
            "supervisor/journal/_rows.c",
            "supervisor/journal/_entry.h",
            "supervisor/data/signatures/vllm.toml",
            "supervisor/data/deploy/systemd/vllm-supervisor.service",
        ):
            assert name in names, name

    def test_the_wheel_carries_the_native_reader_and_the_honest_python_range(
        self, built: Built
    ) -> None:
        """With libsystemd-dev on the build machine the wheel holds the reader program
        (executable) and the rows' parser, for the Python that built it."""
        with zipfile.ZipFile(built.wheel) as wheel:
            modes = {i.filename: i.external_attr >> 16 for i in wheel.infolist()}
            [metadata] = [n for n in modes if n.endswith(".dist-info/METADATA")]
            fields = wheel.read(metadata).decode()
        assert modes[READER] & 0o111 == 0o111, oct(modes[READER])
        assert any(n.startswith("vllm_supervisor/journal/_rows.") for n in modes if ".so" in n)
        tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
        assert f"-{tag}-{tag}-linux_" in built.wheel.name, built.wheel.name
        assert "Requires-Python: >=3.11" in fields.splitlines()
        assert not [n for n in modes if n.startswith("tests/")]


def test_a_wheel_built_without_libsystemd_reads_through_journalctl(tmp_path: Path) -> None:
    """On a build machine without libsystemd's headers the wheel still builds, without the
    reader program; installed, the daemon picks journalctl and the demo still halts its
    crash loop."""
    built = build(tmp_path / "build", without_libsystemd=True)
    with zipfile.ZipFile(built.wheel) as wheel:
        assert READER not in wheel.namelist()
    env = tmp_path / "venv"
    install(env, built.wheel)
    code = (
        "from vllm_supervisor.journal.reader import native_available, resolve_source; "
        "print(native_available(), resolve_source('auto'))"
    )
    assert run(env / "bin" / "python", "-I", "-c", code).split() == ["False", "journalctl"]
    demo = run(env / "bin" / "vllm-supervisor", "demo", timeout=120)
    halted = "halt (decided; nothing is done by triage): known fatal crash 'flashinfer_cubin"
    assert f"decision:    {halted}" in demo


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

    def test_removing_one_leaves_the_other_whole(self, venv: Path, built: Built) -> None:
        """Uninstalling vllm-supervisor does not touch supervisord's files, and back."""
        pip = (sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "-q")
        run(*pip, "uninstall", "-y", "vllm-supervisor")
        assert run(venv / "bin" / "supervisord", "--version").strip().startswith("4.")
        run(*pip, "install", "--no-index", "--no-deps", built.wheel)
        run(*pip, "uninstall", "-y", "supervisor")
        assert run(venv / "bin" / "vllm-supervisor", "--version").startswith("vllm-supervisor")
        assert where(venv, "vllm_supervisor").startswith(str(venv))


def test_the_suite_refuses_the_code_of_another_checkout(tmp_path: Path) -> None:
    """Run in a copy of this checkout, the suite stops before collecting (exit 4) and names
    both places: this interpreter imports vllm_supervisor from here, not from the copy, and
    the copy's tests would otherwise pass or fail on this checkout's code."""
    clone = tracked_copy(tmp_path / "clone")
    (clone / "tests").mkdir()
    for helper in ("conftest.py", "packaged.py", "slack_server.py"):
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
        "print(sorted(str(p.relative_to(setup.DEPLOY)) for p in setup.DEPLOY.rglob('*')"
        " if p.is_file()))"
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
        *(f"cli/{name}" for name in CLI_DOCS),  # setup copies them to /usr/local/share
    ):
        assert name in listed
