"""The one compiled part: the libsystemd journal reader that runs in a child process.

Everything else is in pyproject.toml. The extension is optional: without libsystemd's headers
(Debian `libsystemd-dev`) the build skips it and the supervisor reads through `journalctl`.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """Build the reader if libsystemd's headers are there; otherwise say so and go on."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # any compiler failure means "no native reader"
            print(f"warning: native journal reader not built ({exc})", file=sys.stderr)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"warning: native journal reader not built ({exc})", file=sys.stderr)


setup(
    ext_modules=[
        Extension(
            "vllm_supervisor.journal._sdjournal",
            sources=["supervisor/journal/_sdjournal.c"],
            libraries=["systemd"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        ),
        # The rows' parser, in the daemon's own process: plain C, no library at all.
        Extension(
            "vllm_supervisor.journal._rows",
            sources=["supervisor/journal/_rows.c"],
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        ),
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
