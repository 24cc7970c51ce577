"""The package as a fleet installs it: `python -m build` run on this checkout's tracked files
(an sdist, then the wheel built from that sdist), and the wheels of its dependencies that
scripts/install-deps keeps in .cache/wheels, so that installing needs no package index.

The build runs without isolation (no index here either): the test's environment holds the
build system pyproject.toml asks for (`.[dev]` lists it).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WHEELHOUSE = REPO / ".cache" / "wheels"
# Stands in for a machine without libsystemd-dev: the reader's header fails to compile.
NO_LIBSYSTEMD_HEADER = '#error "no libsystemd headers on this build machine"\n'


@dataclass(frozen=True)
class Built:
    """What `python -m build` wrote."""

    sdist: Path
    wheel: Path


def run(
    *argv: str | Path,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `argv`; fail with the tail of its output unless it exits 0."""
    done = subprocess.run(
        [str(a) for a in argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=env,
        cwd=cwd,
    )
    assert done.returncode == 0, f"{argv} exited {done.returncode}: {done.stderr[-3000:]}"
    return done


def tracked_copy(dest: Path) -> Path:
    """The tracked files but the tests (a build writes into its source tree)."""
    files = run("git", "-C", REPO, "ls-files", "-z").stdout.split("\0")
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


def has_build_module() -> bool:
    """Is PyPA's `build` installed? (A checkout's ignored build/ directory is a namespace
    package of that name too: look for its __main__.)"""
    try:
        return importlib.util.find_spec("build.__main__") is not None
    except ModuleNotFoundError:
        return False


def build(workdir: Path, *, without_libsystemd: bool = False) -> Built:
    """Build the sdist and, from it, the wheel, under `workdir`.

    `without_libsystemd`: as on a machine without libsystemd's headers (the reader program
    is not built; the rows' parser, which needs no libsystemd, still is).
    """
    assert has_build_module(), (
        f"{sys.executable} has no `build` module: run ./scripts/install-deps, then"
        " ./scripts/test (its .venv has `.[dev]`)"
    )
    source = tracked_copy(workdir / "src")
    out = workdir / "dist"
    env = dict(os.environ)
    # The copy has no .git: the version the checkout's history gives (setup.py's SERIES.N).
    commits = run("git", "-C", REPO, "rev-list", "--count", "HEAD").stdout.strip()
    env.setdefault("VLLM_SUPERVISOR_VERSION", f"0.1.{commits}")
    if without_libsystemd:
        headers = workdir / "include"
        (headers / "systemd").mkdir(parents=True)
        (headers / "systemd" / "sd-journal.h").write_text(NO_LIBSYSTEMD_HEADER)
        env["CPATH"] = str(headers)  # searched before the system's include directories
    build_argv = (sys.executable, "-m", "build", "--no-isolation", "--outdir", out, source)
    run(*build_argv, env=env, cwd=workdir)  # not the checkout: its build/ is no `build` module
    [sdist] = out.glob("*.tar.gz")
    [wheel] = out.glob("*.whl")
    return Built(sdist=sdist, wheel=wheel)


def wheelhouse() -> Path:
    """The dependencies' wheels, checked to be there."""
    assert any(WHEELHOUSE.glob("*.whl")), f"no wheels in {WHEELHOUSE}: run scripts/install-deps"
    return WHEELHOUSE


def install(venv: Path, *requirements: str | Path) -> None:
    """Make `venv` (no pip of its own) and install `requirements` into it from the wheelhouse
    only, as a host without an index would: a dependency missing there fails the install."""
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    pip = (sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q")
    run(*pip, "--no-index", "--find-links", wheelhouse(), *requirements)
