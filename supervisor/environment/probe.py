"""What a served unit's interpreter has installed, read by running it.

The served interpreter is another virtual environment, so its distributions are read by running
that interpreter (`python -I -c <probe>`): the probe uses only the standard library, so it works
in any venv, and it prints JSON that is parsed here. Drift and `preflight` share it.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from ..errors import SupervisorError
from ..util.jsontext import loads

NVIDIA_VERSION_PATH = Path("/proc/driver/nvidia/version")

# The probe runs inside the served interpreter (any Python >= 3.8), standard library only.
# Names are normalised as PEP 503 says; the first distribution of a name on sys.path wins, the
# one `import` would load. `Distribution.metadata` is parsed once per distribution because
# `.version` and `.name` would each parse it again. The marker environment is the PEP 508 one,
# so the supervisor can evaluate a requirement's markers as the served interpreter would.
_PROBE = r"""
import json, os, platform, re, sys
from importlib import metadata
want = set(json.loads(sys.argv[1]))
versions, requires = {}, {}
for dist in metadata.distributions():
    md = dist.metadata
    name = md["Name"]
    if not name:
        continue
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in versions:
        continue
    versions[key] = md["Version"]
    if key in want:
        requires[key] = md.get_all("Requires-Dist") or []
def fmt(info):
    text = "%d.%d.%d" % (info.major, info.minor, info.micro)
    if info.releaselevel != "final":
        text += info.releaselevel[0] + str(info.serial)
    return text
markers = {
    "implementation_name": sys.implementation.name,
    "implementation_version": fmt(sys.implementation.version),
    "os_name": os.name,
    "platform_machine": platform.machine(),
    "platform_python_implementation": platform.python_implementation(),
    "platform_release": platform.release(),
    "platform_system": platform.system(),
    "platform_version": platform.version(),
    "python_full_version": platform.python_version(),
    "python_version": ".".join(platform.python_version_tuple()[:2]),
    "sys_platform": sys.platform,
}
print(json.dumps({"python": platform.python_version(), "versions": versions,
                  "requires": requires, "markers": markers}))
"""
_DRIVER_VERSION = re.compile(r"\b(\d+\.\d+(?:\.\d+)*)\b")


class ProbeError(SupervisorError):
    """The served interpreter could not be run or did not report its environment."""


def normalize_name(name: str) -> str:
    """A distribution name as PEP 503 compares it (`Flashinfer_Python` → `flashinfer-python`)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True, slots=True, kw_only=True)
class Probe:
    """Everything the probe script reports about an interpreter's environment."""

    python: str  # the interpreter's version, e.g. "3.11.7"
    versions: Mapping[str, str]  # every installed distribution, normalised name → version
    requires: Mapping[str, tuple[str, ...]]  # Requires-Dist of the distributions asked for
    markers: Mapping[str, str]  # the PEP 508 marker environment of that interpreter


def probe(python: Path, *, requires_of: Sequence[str] = (), timeout_s: float = 5.0) -> Probe:
    """Run `python` in isolated mode and read its installed distributions."""
    wanted = json.dumps(sorted({normalize_name(n) for n in requires_of}))
    argv = [str(python), "-I", "-c", _PROBE, wanted]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout_s, check=False)
    except OSError as exc:
        raise ProbeError(f"{python}: cannot run the interpreter: {exc.strerror}") from exc
    except subprocess.TimeoutExpired as exc:
        raise ProbeError(f"{python}: the environment probe took over {timeout_s:g} s") from exc
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise ProbeError(f"{python}: the environment probe failed: {tail[0]}")
    return _parse_probe(python, done.stdout)


def _parse_probe(python: Path, stdout: bytes) -> Probe:
    try:
        raw = loads(stdout)
        return Probe(
            python=str(raw["python"]),
            versions=MappingProxyType({str(k): str(v) for k, v in raw["versions"].items()}),
            requires=MappingProxyType(
                {str(k): tuple(map(str, v)) for k, v in raw["requires"].items()}
            ),
            markers=MappingProxyType({str(k): str(v) for k, v in raw["markers"].items()}),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProbeError(f"{python}: the environment probe printed no valid report") from exc


def read_nvidia_driver(path: Path = NVIDIA_VERSION_PATH) -> str | None:
    """The loaded NVIDIA kernel module's version, or None without a driver."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("NVRM version:"):
            found = _DRIVER_VERSION.search(line)
            return found.group(1) if found else None
    return None
