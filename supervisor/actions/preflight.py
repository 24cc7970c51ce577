"""`preflight`'s checks, run together: the environment's, then the quarantine's.

A quarantined unit fails its start before the model loads. The failure names the halted crash
in the words its halt recorded, so the message matches the halt's. A record without one
(corrupt, or unreadable) is reported as `QUARANTINED`: the quarantine's own words, since a
quarantine is a state of the supervisor, not a crash a signature could match.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..classify.identities import identities
from ..classify.signatures import SignatureTable
from ..environment.preflight import (
    CheckResult,
    Identity,
    PreflightReport,
    Status,
    check_environment,
)
from .quarantine import Quarantine

QUARANTINED = Identity(
    signature="quarantined",
    title="The unit is quarantined after a fatal crash",
    remediation="Fix the cause, then `vllm-supervisor release UNIT`.",
)


def run_preflight(
    *,
    python: Path | None,
    port: int | None,
    quarantine_dir: Path | Sequence[Path] | None,
    unit: str,
    table: SignatureTable | None,
    state_dir: Path | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> PreflightReport:
    """Run every check that applies, in the words of `table` (None: the shipped table's).

    With `state_dir`, the report also names what changed since the unit's last good start
    (information only: drift alone never fails a preflight).
    """
    started = clock()
    results, drift = check_environment(
        python=python, port=port, unit=unit, lookup=identities(table), state_dir=state_dir
    )
    results.extend(check_quarantine(unit, _as_dirs(quarantine_dir)))
    return PreflightReport(
        unit=unit,
        python=None if python is None else str(python),
        port=port,
        results=tuple(results),
        elapsed_s=clock() - started,
        drift=drift,
    )


def _as_dirs(value: Path | Sequence[Path] | None) -> list[Path]:
    if value is None:
        return []
    return [value] if isinstance(value, Path) else list(value)


def check_quarantine(unit: str, directories: Sequence[Path]) -> Iterator[CheckResult]:
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
                identity=_record_identity(unit, record),
            )
            return
    yield CheckResult(check="quarantine", status=Status.PASSED, detail=f"{unit} is not quarantined")


def _record_identity(unit: str, record: Mapping[str, Any]) -> Identity:
    """The quarantined crash's own signature, so the message matches the halt's."""
    signature = record.get("signature")
    if not isinstance(signature, str):
        remediation = QUARANTINED.remediation.replace("release UNIT", f"release {unit}")
        return Identity(
            signature=QUARANTINED.signature, title=QUARANTINED.title, remediation=remediation
        )
    remediation = record.get("remediation") or ""
    release = f"Then release it: vllm-supervisor release {unit}."
    return Identity(
        signature=signature,
        title=str(record.get("title") or QUARANTINED.title),
        remediation=f"{remediation} {release}".strip(),
        severity=str(record.get("severity") or "fatal"),
    )


def _record_summary(record: Mapping[str, Any]) -> str:
    parts = [str(record[k]) for k in ("root_cause", "reason", "error") if record.get(k)]
    return "; ".join(parts) or "no reason recorded"
