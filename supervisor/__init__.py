"""vllm-supervisor: halts systemd restart loops of LLM servers on deterministic crashes."""

from importlib import metadata

try:
    # setup.py's SERIES.N, N the commits of the build: a newer build has a higher version.
    __version__ = metadata.version("vllm-supervisor")
except metadata.PackageNotFoundError:  # a source tree run without being installed
    __version__ = "0.1.0"
