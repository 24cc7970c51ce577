"""The compiled parts: the libsystemd journal reader (a program, run as the daemon's child) and
the parsers of its rows and of journalctl's export format (extensions, in the daemon's process).

Everything else is in pyproject.toml. Both are optional: without libsystemd's headers (Debian
`libsystemd-dev`) the reader is not built and the supervisor reads through `journalctl`;
without a compiler both formats are parsed in Python.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SERIES = "0.1"  # the version is SERIES.N, N the number of commits: it grows with each build
VERSION_ENV = "VLLM_SUPERVISOR_VERSION"  # a build from a copy without .git (tests/packaged.py)
HERE = Path(__file__).resolve().parent
FLAGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]
READER_SOURCE = "supervisor/journal/journal_reader.c"
# Installed beside the package's modules, where `reader.NATIVE_READER` looks for it.
READER_PROGRAM = "vllm-supervisor-journal-reader"


class OptionalBuildExt(build_ext):
    """Build what the machine can build; say what was skipped and go on."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # any compiler failure means "not built"
            print(f"warning: native parts not built ({exc})", file=sys.stderr)
            return
        self._build_reader()

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"warning: {ext.name} not built ({exc})", file=sys.stderr)

    def _package_dir(self) -> Path:
        """Where the journal package's modules go: the in-place tree, or build_lib."""
        return Path(self.get_ext_fullpath("vllm_supervisor.journal._rows")).parent

    def _build_reader(self) -> None:
        """Link the reader program beside the journal package's modules."""
        try:
            objects = self.compiler.compile(
                [READER_SOURCE],
                output_dir=str(Path(self.build_temp) / "reader"),
                extra_postargs=FLAGS,
            )
            self.compiler.link_executable(
                objects,
                READER_PROGRAM,
                output_dir=str(self._package_dir()),
                libraries=["systemd"],
                # As an extension's link gets them (a libsystemd outside the default paths).
                extra_postargs=shlex.split(os.environ.get("LDFLAGS", "")),
            )
        except Exception as exc:
            print(f"warning: native journal reader not built ({exc})", file=sys.stderr)

    def get_outputs(self) -> list[str]:
        program = self._package_dir() / READER_PROGRAM
        return [*super().get_outputs(), *([str(program)] if program.exists() else [])]


def build_version() -> str:
    """SERIES.N from the git history, so that `pip install` of a newer build replaces an older
    one; else what the environment or an sdist's PKG-INFO says; else SERIES.0."""
    given = os.environ.get(VERSION_ENV, "").strip()
    if given:
        return given
    if (HERE / ".git").exists():
        try:
            done = subprocess.run(
                ["git", "-C", str(HERE), "rev-list", "--count", "HEAD"],
                capture_output=True,
                text=True,
                check=True,
                timeout=30,
            )
            return f"{SERIES}.{int(done.stdout.strip())}"
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            print(f"warning: no version from git ({exc}): {SERIES}.0", file=sys.stderr)
    info = HERE / "PKG-INFO"
    if info.is_file():
        found = re.search(r"^Version: (\S+)$", info.read_text(encoding="utf-8"), re.MULTILINE)
        if found:
            return found.group(1)
    return f"{SERIES}.0"


setup(
    version=build_version(),
    ext_modules=[
        # The rows' parser, in the daemon's own process: plain C, no library at all.
        Extension(
            "vllm_supervisor.journal._rows",
            sources=["supervisor/journal/_rows.c"],
            depends=["supervisor/journal/_entry.h"],
            extra_compile_args=FLAGS,
        ),
        # journalctl's export format (the fallback reader's), likewise in-process and plain C.
        Extension(
            "vllm_supervisor.journal._export",
            sources=["supervisor/journal/_export.c"],
            depends=["supervisor/journal/_entry.h"],
            extra_compile_args=FLAGS,
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
