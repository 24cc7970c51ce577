"""`vllm-supervisor preflight UNIT`: catch a deterministic crash before the model loads.

Several fatal crashes are decided by the environment alone: `flashinfer-cubin` not matching
`flashinfer-python`, a package the server requires at a version it does not accept, the port
already bound by a stale server, a unit that is quarantined. Loading a large model takes minutes
before those crash; these checks take well under two seconds. Run as `ExecStartPre=` (exit 1 fails
the start), a failure prints the same signature id, title and remediation the crash would have.

Package data are read inside the served interpreter by the probe of `environment` (standard
library only, so no `packaging` is needed there); requirements are evaluated here with
`packaging`, against that interpreter's own PEP 508 marker environment.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol, TextIO

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from ..actions.quarantine import Quarantine, quarantine_dirs
from ..actions.systemd import ask_once
from ..config import DriftConfig
from ..engines.profiles import Engines, follow
from ..environment.execstart import interpreter_from_exec_start, serving_port
from ..environment.log import EnvironmentLog
from ..environment.ports import holders
from ..environment.probe import (
    Probe,
    ProbeError,
    normalize_name,
    probe,
    read_nvidia_driver,
)
from ..environment.snapshot import diff as env_diff
from ..environment.snapshot import render_changes, snapshot_from_probe
from ..errors import SupervisorError, SystemdError
from ..store import Store

EXIT_OK = 0
EXIT_FAILED = 1
_NO_CAPTURES: Mapping[str, str] = MappingProxyType({})


class SignatureInfo(Protocol):
    """What preflight reads of one entry of the signature table."""

    @property
    def id(self) -> str: ...
    @property
    def title(self) -> str: ...
    @property
    def remediation(self) -> str | None: ...
    @property
    def severity(self) -> object: ...
    def render_remediation(self, captures: Mapping[str, str]) -> str | None:
        """The remediation with `{capture}` names filled in."""
        ...


class SignatureTable(Protocol):
    """The part of `supervisor.classify.signatures.SignatureTable` preflight uses."""

    @property
    def signatures(self) -> Sequence[SignatureInfo]: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Identity:
    """The signature a failed check reports: the one its crash would have matched."""

    signature: str
    title: str
    remediation: str
    severity: str = "fatal"


@dataclass(frozen=True, slots=True, kw_only=True)
class Family:
    """Distributions that must be installed at one version (when installed at all)."""

    members: tuple[str, ...]
    signature: str  # the id of the crash a mismatch causes
    # member -> the capture name the signature's remediation uses for its version
    captures: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


# flashinfer refuses to start when its packages differ (flashinfer/jit/env.py: "flashinfer-cubin
# version (X) does not match flashinfer version (Y)"); cubin and jit-cache are checked against
# flashinfer-python separately, each with its own crash. Local labels such as flashinfer-jit-cache's
# "+cu129" are not part of the version compared. `captures` are the names the signatures'
# remediation texts use (config/signatures/flashinfer.toml).
DEFAULT_FAMILIES: tuple[Family, ...] = (
    Family(
        members=("flashinfer-python", "flashinfer-cubin"),
        signature="flashinfer_cubin_mismatch",
        captures=MappingProxyType({"flashinfer-python": "flashinfer", "flashinfer-cubin": "cubin"}),
    ),
    Family(
        members=("flashinfer-python", "flashinfer-jit-cache"),
        signature="flashinfer_jit_cache_mismatch",
        captures=MappingProxyType(
            {"flashinfer-python": "flashinfer", "flashinfer-jit-cache": "jit_cache"}
        ),
    ),
)
# The served packages whose declared requirements are checked, when installed: the engine
# files' packages.
SERVED_PACKAGES: tuple[str, ...]


def _use_engines(engines: Engines) -> None:
    """The packages of the engine files in force (profiles.follow)."""
    global SERVED_PACKAGES
    SERVED_PACKAGES = engines.packages


follow(_use_engines)
# Ids the signature table may use for a check; the first one it has wins.
PORT_SIGNATURES: tuple[str, ...] = ("port_in_use", "address_in_use", "eaddrinuse")
REQUIREMENT_SIGNATURES: tuple[str, ...] = ("requirement_unsatisfied", "dependency_conflict")
PROBE_SIGNATURE = "environment_probe_failed"
QUARANTINE_SIGNATURE = "quarantined"

# Used when the table lacks the id (or no table is given), so a failure always explains itself.
BUILTIN: Mapping[str, Identity] = {
    i.signature: i
    for i in (
        Identity(
            signature="flashinfer_cubin_mismatch",
            title="flashinfer-cubin and flashinfer-python versions differ",
            remediation="Install flashinfer-cubin at the installed flashinfer-python's version "
            "(or pin flashinfer-python to the cubin's).",
        ),
        Identity(
            signature="flashinfer_jit_cache_mismatch",
            title="flashinfer-jit-cache and flashinfer-python versions differ",
            remediation="Install the flashinfer-jit-cache built for the installed "
            "flashinfer-python from https://flashinfer.ai/whl/ (matching your CUDA suffix).",
        ),
        Identity(
            signature="port_in_use",
            title="The server's port is already in use",
            remediation="Stop the process holding the port (`ss -ltnp 'sport = :PORT'`), "
            "often a previous server that did not exit, or change --port.",
        ),
        Identity(
            signature="requirement_unsatisfied",
            title="An installed package does not satisfy the server's requirements",
            remediation="Reinstall the server's pinned dependencies in its environment "
            "(e.g. `pip install 'vllm==X.Y.Z'`), then run `pip check`.",
        ),
        Identity(
            signature=PROBE_SIGNATURE,
            title="The server's Python interpreter cannot be run",
            remediation="Check the interpreter path of the unit's ExecStart= (or --python) and "
            "that its virtual environment is intact.",
        ),
        Identity(
            signature=QUARANTINE_SIGNATURE,
            title="The unit is quarantined after a fatal crash",
            remediation="Fix the cause, then `vllm-supervisor release UNIT`.",
        ),
    )
}


class Status(StrEnum):
    """The outcome of one check."""

    PASSED = "pass"
    FAILED = "fail"
    SKIPPED = "skip"


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


def run_preflight(
    *,
    python: Path | None,
    port: int | None,
    quarantine_dir: Path | Sequence[Path] | None,
    unit: str,
    table: SignatureTable | None,
    families: Sequence[Family] = DEFAULT_FAMILIES,
    state_dir: Path | None = None,
    drift_packages: Sequence[str] = DriftConfig().packages,
    timeout_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
) -> PreflightReport:
    """Run every check that applies; none of them imports the server or loads a model.

    With `state_dir`, the report also names what changed since the unit's last good start
    (information only: drift alone never fails a preflight).
    """
    started = clock()
    lookup = _identities(table)
    results: list[CheckResult] = []
    found = _probe_or_fail(python, timeout_s, lookup, results)
    drift = None
    if found is not None and python is not None:
        results.extend(check_families(found.versions, families, lookup))
        results.extend(check_requirements(found, lookup))
        if state_dir is not None:
            drift = drift_since_last_good(found, python, unit, state_dir, drift_packages)
    results.append(check_port(port, lookup))
    results.extend(check_quarantine(unit, _as_dirs(quarantine_dir), lookup))
    return PreflightReport(
        unit=unit,
        python=None if python is None else str(python),
        port=port,
        results=tuple(results),
        elapsed_s=clock() - started,
        drift=drift,
    )


Lookup = Callable[[Sequence[str], Mapping[str, str]], Identity]


def _identities(table: SignatureTable | None) -> Lookup:
    """Find the first of some ids in the table, else the built-in entry of the first id."""
    known = {s.id: s for s in table.signatures} if table is not None else {}

    def lookup(ids: Sequence[str], captures: Mapping[str, str] = _NO_CAPTURES) -> Identity:
        for wanted in ids:
            if wanted in known:
                sig = known[wanted]
                fallback = BUILTIN.get(wanted)
                remediation = sig.render_remediation(captures)
                return Identity(
                    signature=sig.id,
                    title=sig.title,
                    remediation=remediation or (fallback.remediation if fallback else ""),
                    severity=str(sig.severity),
                )
        return BUILTIN[ids[0]]

    return lookup


def _probe_or_fail(
    python: Path | None, timeout_s: float, lookup: Lookup, results: list[CheckResult]
) -> Probe | None:
    if python is None:
        results.append(
            CheckResult(check="interpreter", status=Status.SKIPPED, detail="no Python interpreter")
        )
        return None
    try:
        return probe(python, requires_of=SERVED_PACKAGES, timeout_s=timeout_s)
    except ProbeError as exc:
        results.append(
            CheckResult(
                check="interpreter",
                status=Status.FAILED,
                detail=str(exc),
                identity=lookup([PROBE_SIGNATURE], _NO_CAPTURES),
            )
        )
        return None


def check_families(
    versions: Mapping[str, str], families: Sequence[Family], lookup: Lookup
) -> Iterator[CheckResult]:
    """Fail each family whose installed members have different versions."""
    for family in families:
        members = [normalize_name(m) for m in family.members]
        installed = {m: versions[m] for m in members if m in versions}
        listing = ", ".join(f"{m} {v}" for m, v in installed.items()) or "none installed"
        if len({_public(v) for v in installed.values()}) > 1:
            yield CheckResult(
                check="families",
                status=Status.FAILED,
                detail=f"{listing}: must be one version",
                identity=lookup([family.signature], _captures(family, installed)),
            )
        else:
            yield CheckResult(check="families", status=Status.PASSED, detail=listing)


def _captures(family: Family, installed: Mapping[str, str]) -> dict[str, str]:
    """The versions under the capture names the signature's remediation uses."""
    named = {family.captures[m]: v for m, v in installed.items() if m in family.captures}
    return {**installed, **named}


def _public(version: str) -> str:
    try:
        return Version(version).public
    except InvalidVersion:
        return version


def check_requirements(found: Probe, lookup: Lookup) -> Iterator[CheckResult]:
    """Fail each requirement of an installed served package that the environment breaks."""
    served = [n for n in SERVED_PACKAGES if n in found.requires]
    if not served:
        names = ", ".join(SERVED_PACKAGES)
        yield CheckResult(
            check="requirements", status=Status.SKIPPED, detail=f"none of {names} is installed"
        )
        return
    problems = [p for name in served for p in _unmet(name, found)]
    for problem in problems:
        yield CheckResult(
            check="requirements",
            status=Status.FAILED,
            detail=problem,
            identity=lookup(REQUIREMENT_SIGNATURES, _NO_CAPTURES),
        )
    if not problems:
        which = ", ".join(f"{n} {found.versions[n]}" for n in served)
        yield CheckResult(check="requirements", status=Status.PASSED, detail=f"{which}: satisfied")


def _unmet(name: str, found: Probe) -> Iterator[str]:
    """Like `pip check` for one distribution: its requirements the environment breaks."""
    environment = {**found.markers, "extra": ""}
    owner = f"{name} {found.versions[name]}"
    for text in found.requires[name]:
        try:
            req = Requirement(text)
        except InvalidRequirement:
            continue  # pip would not have installed it either; nothing to compare
        if req.marker is not None and not req.marker.evaluate(environment):
            continue
        have = found.versions.get(normalize_name(req.name))
        if have is None:
            yield f"{owner} requires {req}, which is not installed"
        elif req.url is None and not _satisfies(req, have):
            yield f"{owner} requires {req}, but {req.name} {have} is installed"


def _satisfies(req: Requirement, version: str) -> bool:
    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return True  # a legacy version cannot be compared; don't block a start on it


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
                identity=lookup(PORT_SIGNATURES, {"port": str(port)}),
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


def check_quarantine(
    unit: str, directories: Sequence[Path], lookup: Lookup
) -> Iterator[CheckResult]:
    """Fail while a quarantine record exists; report the crash that caused it."""
    for directory in directories:
        try:
            record = Quarantine(directory).read(unit)
        except OSError as exc:
            record = {"error": f"cannot read {directory}: {exc.strerror}"}
        if record is not None:
            yield CheckResult(
                check="quarantine",
                status=Status.FAILED,
                detail=f"{unit} is quarantined ({directory}): {_record_summary(record)}",
                identity=_record_identity(unit, record, lookup),
            )
            return
    yield CheckResult(check="quarantine", status=Status.PASSED, detail=f"{unit} is not quarantined")


def _record_identity(unit: str, record: Mapping[str, Any], lookup: Lookup) -> Identity:
    """The quarantined crash's own signature, so the message matches the halt's."""
    quarantined = lookup([QUARANTINE_SIGNATURE], _NO_CAPTURES)
    quarantined = dataclasses.replace(
        quarantined, remediation=quarantined.remediation.replace("release UNIT", f"release {unit}")
    )
    signature = record.get("signature")
    if not isinstance(signature, str):
        return quarantined
    remediation = record.get("remediation") or ""
    release = f"Then release it: vllm-supervisor release {unit}."
    return Identity(
        signature=signature,
        title=str(record.get("title") or quarantined.title),
        remediation=f"{remediation} {release}".strip(),
        severity=str(record.get("severity") or "fatal"),
    )


def _record_summary(record: Mapping[str, Any]) -> str:
    parts = [str(record[k]) for k in ("root_cause", "reason", "error") if record.get(k)]
    return "; ".join(parts) or "no reason recorded"


def _as_dirs(value: Path | Sequence[Path] | None) -> list[Path]:
    if value is None:
        return []
    return [value] if isinstance(value, Path) else list(value)


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
    return render_changes(env_diff(baseline, now))


def preflight_main(
    unit: str,
    *,
    python: Path | None,
    port: int | None,
    runtime_dir: Path,
    state_dir: Path,
    output_format: str,
    exec_start: Callable[[str], list[str] | None] | None = None,
    table: SignatureTable | None = None,
    out: TextIO | None = None,
) -> int:
    """`vllm-supervisor preflight UNIT`: 0 when every check passes, 1 otherwise.

    Without `--python`/`--port`, both are read from the unit's ExecStart= (systemd over
    D-Bus); a unit with no Python (TGI's launcher) skips the package checks. `table` is the
    signature table of the config (None: the built-in families' own words apply).
    """
    stream = out if out is not None else sys.stdout
    if python is None or port is None:
        argv = (exec_start or exec_start_argv)(unit)
        if argv is not None:
            python = python or interpreter_from_exec_start(argv)
            port = port if port is not None else serving_port(argv)
    report = run_preflight(
        python=python,
        port=port,
        quarantine_dir=quarantine_dirs(runtime_dir, state_dir),
        unit=unit,
        table=table,
        state_dir=state_dir,
    )
    if output_format == "json":
        stream.write(json.dumps(report.to_json(), indent=2) + "\n")
    else:
        stream.write(report.render_text())
    return EXIT_OK if report.ok else EXIT_FAILED


def exec_start_argv(unit: str, *, timeout_s: float = 2.0) -> list[str] | None:
    """The argv of a unit's (first) ExecStart=, as systemd reports it over D-Bus (the reader the
    daemon's drift uses, actions.systemd); None when systemd cannot say."""

    try:
        return ask_once(lambda client: client.exec_start(unit), timeout_s=timeout_s) or None
    except (SystemdError, OSError, TimeoutError):
        return None
