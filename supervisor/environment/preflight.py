"""Preflight's checks of a served environment: catch a deterministic crash before the model loads.

Several fatal crashes are decided by the environment alone: `flashinfer-cubin` not matching
`flashinfer-python`, a package the server requires at a version it does not accept, the port
already bound by a stale server. Loading a large model takes minutes before those crash; these
checks take well under two seconds, and none of them imports the server or loads a model.

A failed check carries the `Identity` its crash would have: the signature id, title and
remediation, in the words of the signature table (`Lookup`, given by the caller, which knows the
table). What this module names itself is only what no crash line says: that the probe could not
run the interpreter.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from ..config import DriftConfig
from ..engines.profiles import Engines, follow
from ..errors import SupervisorError
from ..store import Store
from .log import EnvironmentLog
from .ports import PORT_IN_USE, holders
from .probe import Probe, ProbeError, probe, read_nvidia_driver
from .requirements import DEFAULT_FAMILIES, Family, unmet
from .snapshot import diff, render_changes, snapshot_from_probe


class Status(StrEnum):
    """The outcome of one check."""

    PASSED = "pass"
    FAILED = "fail"
    SKIPPED = "skip"


@dataclass(frozen=True, slots=True, kw_only=True)
class Identity:
    """The signature a failed check reports: the one its crash would have matched."""

    signature: str
    title: str
    remediation: str
    severity: str = "fatal"


Lookup = Callable[[str, Mapping[str, str]], Identity]
"""A signature id and the captures its remediation names → the identity to report."""

# The served interpreter cannot be run: the server's crash would be systemd's failed exec or an
# unreadable venv, no line a signature matches, so this failure is the probe's own.
PROBE_FAILED = Identity(
    signature="environment_probe_failed",
    title="The server's Python interpreter cannot be run",
    remediation="Check the interpreter path of the unit's ExecStart= (or --python) and "
    "that its virtual environment is intact.",
)
REQUIREMENT_SIGNATURE = "requirement_unsatisfied"
_NO_CAPTURES: Mapping[str, str] = {}


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckResult:
    """One check's outcome; a failure carries the signature its crash would have produced."""

    check: str  # families | requirements | port | quarantine | interpreter
    status: Status
    detail: str
    identity: Identity | None = None

    def to_json(self) -> dict[str, Any]:
        """One element of the `checks` list of `preflight --format json`."""
        found = self.identity
        return {
            "check": self.check,
            "status": self.status.value,
            "detail": self.detail,
            "signature": found.signature if found else None,
            "severity": found.severity if found else None,
            "title": found.title if found else None,
            "remediation": found.remediation if found else None,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class PreflightReport:
    """Every check of one preflight run."""

    unit: str
    python: str | None
    port: int | None
    results: tuple[CheckResult, ...]
    elapsed_s: float
    drift: str | None = None  # changes since the unit's last good start, when known

    @property
    def ok(self) -> bool:
        """True when no check failed."""
        return all(r.status is not Status.FAILED for r in self.results)

    def to_json(self) -> dict[str, Any]:
        """The object `preflight --format json` prints."""
        return {
            "unit": self.unit,
            "ok": self.ok,
            "python": self.python,
            "port": self.port,
            "elapsed_s": round(self.elapsed_s, 3),
            "drift": self.drift,
            "checks": [r.to_json() for r in self.results],
        }

    def render_text(self) -> str:
        """`FAIL <id>: <title>` plus details and remediation per failed signature (two checks
        finding one crash, the packages and the quarantine, say it once); a summary line."""
        lines: list[str] = []
        groups: dict[str, list[str]] = {}  # signature -> its FAIL block, shared by its checks
        for result in self.results:
            found = result.identity
            if result.status is not Status.FAILED or found is None:
                lines.append(f"{result.status.value.upper()} {result.check}: {result.detail}")
                continue
            block = groups.get(found.signature)
            if block is None:
                block = groups[found.signature] = [f"FAIL {found.signature}: {found.title}"]
                lines.append(found.signature)  # where the block goes
            block += [f"  {t}" for t in (result.detail, found.remediation) if f"  {t}" not in block]
        lines = [line for each in lines for line in groups.get(each, [each])]
        if self.drift:
            lines.append(f"changed since the last good start: {self.drift}")
        failed = sum(line.startswith("FAIL ") for line in lines)  # one per crash it predicts
        verdict = f"{failed} failed" if failed else "all passed"
        lines.append(f"preflight {self.unit}: {verdict} in {self.elapsed_s:.2f} s")
        return "\n".join(lines) + "\n"


# The served packages whose declared requirements are checked, when installed: the engine
# files' packages.
SERVED_PACKAGES: tuple[str, ...]


def _use_engines(engines: Engines) -> None:
    """The packages of the engine files in force (profiles.follow)."""
    global SERVED_PACKAGES
    SERVED_PACKAGES = engines.packages


follow(_use_engines)


def check_environment(
    *,
    python: Path | None,
    port: int | None,
    unit: str,
    lookup: Lookup,
    families: Sequence[Family] = DEFAULT_FAMILIES,
    state_dir: Path | None = None,
    drift_packages: Sequence[str] = DriftConfig().packages,
    timeout_s: float = 5.0,
) -> tuple[list[CheckResult], str | None]:
    """The interpreter, its packages and the port, checked; with `state_dir`, also what changed
    since the unit's last good start (information only: drift alone never fails a preflight)."""
    found, results = check_interpreter(python, timeout_s)
    drift = None
    if found is not None and python is not None:
        results.extend(check_families(found.versions, families, lookup))
        results.extend(check_requirements(found, lookup))
        if state_dir is not None:
            drift = drift_since_last_good(found, python, unit, state_dir, drift_packages)
    results.append(check_port(port, lookup))
    return results, drift


def check_interpreter(
    python: Path | None, timeout_s: float = 5.0
) -> tuple[Probe | None, list[CheckResult]]:
    """The interpreter's installed packages; a result only when there is none to check."""
    if python is None:
        skipped = CheckResult(
            check="interpreter", status=Status.SKIPPED, detail="no Python interpreter"
        )
        return None, [skipped]
    try:
        return probe(python, requires_of=SERVED_PACKAGES, timeout_s=timeout_s), []
    except ProbeError as exc:
        failed = CheckResult(
            check="interpreter", status=Status.FAILED, detail=str(exc), identity=PROBE_FAILED
        )
        return None, [failed]


def check_families(
    versions: Mapping[str, str], families: Sequence[Family], lookup: Lookup
) -> Iterator[CheckResult]:
    """Fail each family whose installed members have different versions."""
    for family in families:
        installed = family.installed(versions)
        listing = ", ".join(f"{m} {v}" for m, v in installed.items()) or "none installed"
        if family.differs(installed):
            yield CheckResult(
                check="families",
                status=Status.FAILED,
                detail=f"{listing}: must be one version",
                identity=lookup(family.signature, family.captured(installed)),
            )
        else:
            yield CheckResult(check="families", status=Status.PASSED, detail=listing)


def check_requirements(found: Probe, lookup: Lookup) -> Iterator[CheckResult]:
    """Fail each requirement of an installed served package that the environment breaks."""
    served = [n for n in SERVED_PACKAGES if n in found.requires]
    if not served:
        names = ", ".join(SERVED_PACKAGES)
        yield CheckResult(
            check="requirements", status=Status.SKIPPED, detail=f"none of {names} is installed"
        )
        return
    problems = [p for name in served for p in unmet(name, found)]
    for problem in problems:
        yield CheckResult(
            check="requirements",
            status=Status.FAILED,
            detail=problem,
            identity=lookup(REQUIREMENT_SIGNATURE, _NO_CAPTURES),
        )
    if not problems:
        which = ", ".join(f"{n} {found.versions[n]}" for n in served)
        yield CheckResult(check="requirements", status=Status.PASSED, detail=f"{which}: satisfied")


def check_port(port: int | None, lookup: Lookup) -> CheckResult:
    """Fail when something already holds `port` on the wildcard or the loopback address."""
    if port is None:
        return CheckResult(check="port", status=Status.SKIPPED, detail="no port configured")
    for host in ("0.0.0.0", "127.0.0.1"):  # noqa: S104 - a bind test, closed at once
        error = _bind_error(host, port)
        if error == errno.EADDRINUSE:
            held = "; ".join(h.describe() for h in holders(port))
            return CheckResult(
                check="port",
                status=Status.FAILED,
                detail=f"port {port} is already bound ({host}:{port})"
                + (f" by {held}" if held else ""),
                identity=lookup(PORT_IN_USE, {"port": str(port)}),
            )
        if error is not None:
            detail = f"cannot test port {port}: errno {errno.errorcode.get(error, error)}"
            return CheckResult(check="port", status=Status.SKIPPED, detail=detail)
    return CheckResult(check="port", status=Status.PASSED, detail=f"port {port} is free")


def _bind_error(host: str, port: int) -> int | None:
    """The errno of binding `host:port`, as a server would (SO_REUSEADDR, so TIME_WAIT is ok)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno
    return None


def drift_since_last_good(
    found: Probe, python: Path, unit: str, state_dir: Path, packages: Sequence[str]
) -> str | None:
    """What changed since the unit's last good start, from the daemon's state database."""
    store = Store.existing_in_directory(state_dir)
    if store is None:
        return None
    try:
        baseline = EnvironmentLog(store).last_good(unit)
    except SupervisorError:
        return None  # information only: an unreadable database must not fail a start
    finally:
        store.close()
    if baseline is None:
        return None
    now = snapshot_from_probe(
        found, packages, executable=python, nvidia_driver=read_nvidia_driver()
    )
    return render_changes(diff(baseline, now))
