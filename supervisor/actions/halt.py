"""Halting a restart loop: quarantine the unit first, then stop it through systemd.

The order matters (docs/DESIGN.md §3): the quarantine record makes the unit's `ExecCondition=` gate
skip any start that races us, and only then does StopUnit cancel a pending restart or stop a
start already under way. Stopping is idempotent and retried with bounded exponential backoff on
retryable D-Bus errors; every attempt is bounded by `timeout_s`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import structlog

from ..errors import SystemdError
from ..model import Outcome
from ..util.retry import Backoff
from ..util.text import bounded
from .amend import amend
from .evidence import ENVIRONMENT_KEY, EVIDENCE_KEY, environment_of, evidence_of
from .quarantine import Quarantine
from .systemd import SystemdClient

_log = structlog.get_logger(__name__)
T = TypeVar("T")

SYSTEMD_RETRY = Backoff(0.2, 5.0, jitter=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class HaltResult:
    """What `Halter.halt` did."""

    quarantined: Path | None  # the record written (None when writing failed)
    stopped: bool  # systemd was told: StopUnit succeeded, was not needed, or the gate refuses
    error: SystemdError | None  # the final systemd failure, after retries
    latency_s: float  # from the call to the end of the stop
    stop_job: str | None = None  # the D-Bus job path of StopUnit, when one was issued
    detail: str = ""  # one human sentence: what was done
    # The invocation of the halt that already stood (its record is kept, its count raised).
    repeat_of: str | None = None

    @property
    def complete(self) -> bool:
        """The unit is quarantined and systemd was told (or had nothing to be told)."""
        return self.quarantined is not None and self.stopped and self.error is None

    @property
    def failure_reason(self) -> str | None:
        """A bounded label for what failed (metric label), or None when the halt is complete."""
        if self.quarantined is None:
            return "quarantine"
        if self.error is not None:
            return self.error.reason
        return None


class Halter:
    """Quarantines and stops a unit after a fatal verdict; restarts a hung one."""

    def __init__(
        self,
        quarantine: Quarantine,
        systemd: SystemdClient | None,
        *,
        attempts: int,
        timeout_s: float,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
        python_of: Callable[[str], str | None] = lambda unit: None,
    ) -> None:
        """`python_of` names a unit's configured interpreter (else its ExecStart= tells)."""
        self._quarantine = quarantine
        self._python_of = python_of
        self._systemd = systemd
        self._attempts = max(1, attempts)
        self._timeout_s = timeout_s
        self._sleep = sleep
        self._clock = clock

    @property
    def quarantine(self) -> Quarantine:
        """Where this halter writes its records."""
        return self._quarantine

    @property
    def controls_systemd(self) -> bool:
        """False when systemd control is disabled: records only, no stop or restart."""
        return self._systemd is not None

    async def halt(self, unit: str, outcome: Outcome, *, stop: bool) -> HaltResult:
        """Quarantine `unit` for `outcome`, then (with `stop`) stop it through systemd.

        The record first: it makes the unit's gate refuse any start that races the stop.
        """
        start = self._clock()
        standing = self._standing(unit, outcome)
        path, q_error = await self._write_record(unit, quarantine_record(outcome, standing))
        stopped, job, error = await self._stop(unit) if stop else (True, None, None)
        latency_s = self._clock() - start
        if path is not None and standing is None:
            # A standing halt keeps the fingerprint it was decided with.
            await self._keep_environment(unit, outcome.invocation.invocation_id)
        return HaltResult(
            repeat_of=None if standing is None else standing.get("invocation_id"),
            stopped=stopped,
            quarantined=path,
            error=error,
            stop_job=job,
            latency_s=latency_s,
            detail=_describe(unit, (path, q_error), stop, stopped, job, error),
        )

    async def _keep_environment(self, unit: str, invocation_id: str | None) -> None:
        """Add what the unit ran with to its record, so the gate lifts the halt once that
        changes. After the record and the stop: neither waits for these D-Bus round trips."""
        environment = await environment_of(unit, self._systemd, python=self._python_of(unit))
        if environment is None:
            return
        try:
            await asyncio.to_thread(
                amend, self._quarantine, unit, invocation_id, {ENVIRONMENT_KEY: environment}
            )
        except OSError as exc:
            _log.warning("quarantine_amend_failed", unit=unit, error=str(exc))

    async def stop(self, unit: str) -> str | None:
        """Stop `unit` (retried); the job path. Raises SystemdError after retries."""
        _, job, error = await self._stop(unit)
        if error is not None:
            raise error
        return job

    async def restart(self, unit: str) -> str:
        """Restart `unit` (a hung engine); the job path. Raises SystemdError after retries."""
        if self._systemd is None:
            raise SystemdError(
                f"restart {unit}: systemd control is disabled",
                reason="bus_unavailable",
                retryable=False,
            )
        client = self._systemd
        return await self._retry("restart", unit, lambda: client.restart_unit(unit))

    def _standing(self, unit: str, outcome: Outcome) -> dict[str, Any] | None:
        """The record of an earlier invocation's halt, still in force: the loop it began is
        the same story (the unit was started again despite it, by hand or without the gate)."""
        try:
            record = self._quarantine.read(unit)
        except OSError:
            return None
        if record is None or record.get("invocation_id") == outcome.invocation.invocation_id:
            return None
        return record

    async def _write_record(
        self, unit: str, record: dict[str, Any]
    ) -> tuple[Path | None, str | None]:
        try:
            return await self._quarantine.write_async(unit, record), None
        except OSError as exc:
            # Stopping is still worth doing: it cancels the pending restart on its own.
            _log.error("quarantine_write_failed", unit=unit, error=str(exc))
            return None, f"{type(exc).__name__}: {exc}"

    async def _stop(self, unit: str) -> tuple[bool, str | None, SystemdError | None]:
        if self._systemd is None:
            return False, None, None
        client = self._systemd

        async def attempt() -> str | None:
            state = await client.unit_state(unit)
            if not state.restarting_or_running:
                return None  # Already down; StopUnit would be a no-op.
            return await client.stop_unit(unit)

        try:
            job = await self._retry("stop", unit, attempt)
        except SystemdError as exc:
            return False, None, exc
        return True, job, None

    async def _retry(self, action: str, unit: str, op: Callable[[], Awaitable[T]]) -> T:
        errors: list[SystemdError] = []
        while len(errors) < self._attempts:
            try:
                async with asyncio.timeout(self._timeout_s):
                    return await op()
            except TimeoutError:
                error = SystemdError(
                    f"{action} {unit}: no answer in {self._timeout_s}s",
                    reason="timeout",
                    retryable=True,
                )
            except SystemdError as exc:
                error = exc
            if not error.retryable or len(errors) + 1 == self._attempts:
                errors.append(error)
                break
            if not errors or errors[-1].reason != error.reason:
                # A repeated identical failure is logged once, not once per attempt.
                _log.warning("systemd_retry", action=action, unit=unit, reason=error.reason)
            errors.append(error)
            await self._sleep(SYSTEMD_RETRY.delay(len(errors)))
        last = errors[-1]
        _log.error(
            "systemd_action_failed",
            action=action,
            unit=unit,
            attempts=len(errors),
            reason=last.reason,
            error=str(last),
        )
        raise SystemdError(
            f"{action} {unit} failed after {len(errors)} attempt(s): {last}",
            reason=last.reason,
            retryable=last.retryable,
        ) from last


def quarantine_record(outcome: Outcome, standing: dict[str, Any] | None = None) -> dict[str, Any]:
    """The JSON record kept while a unit is quarantined: why, when, which invocation, and
    what the halt rests on (its evidence; the environment fingerprint is added after the stop).

    With a `standing` record (an earlier halt still in force) that record is kept, since when
    and by which invocation, and only its crash count and latest crash move on."""
    now = datetime.now(UTC).isoformat(timespec="seconds")
    if standing is not None:
        count = standing.get("crashes")
        return {
            **standing,
            "crashes": (count if isinstance(count, int) else 1) + 1,
            "last_invocation_id": outcome.invocation.invocation_id,
            "last_time": now,
        }
    verdict, inv = outcome.verdict, outcome.invocation
    return {
        "time": now,
        "crashes": 1,
        "invocation_id": inv.invocation_id,
        "signature": verdict.signature,
        "severity": verdict.severity.value,
        "title": _shown(verdict.title),
        "root_cause": _shown(verdict.root_cause),
        "remediation": _shown(verdict.remediation),
        "fingerprint": verdict.fingerprint,
        # The rule and the crashes it rested on: the fleet's proof says both (supervisor.fleet).
        "rule": outcome.decision.rule.value,
        "loop_crashes": outcome.decision.crashes,
        # A lift rests on what the halt named: these packages' changes, not any package's.
        "packages": list(verdict.packages),
        # The reason may quote outside text (a port holder's command line): escaped, bounded.
        "reason": _shown(outcome.decision.reason),
        "exit_code": inv.exit_code,
        "exit_status": inv.exit_status,
        "restarts": inv.restarts,
        EVIDENCE_KEY: evidence_of(outcome),
        ENVIRONMENT_KEY: None,
    }


RECORD_TEXT_LIMIT = 2000  # characters of a text a record keeps: shown, never parsed


def _shown(text: str | None) -> str | None:
    """Text for a record that history, status, Slack and Alertmanager show (a line or a
    command line may be anyone's)."""
    return None if text is None else bounded(text, RECORD_TEXT_LIMIT)


def _describe(
    unit: str,
    record: tuple[Path | None, str | None],
    asked: bool,
    stopped: bool,
    job: str | None,
    error: SystemdError | None,
) -> str:
    path, why_not = record
    parts = [f"quarantined {unit} at {path}" if path else f"could not quarantine {unit}: {why_not}"]
    if not asked:
        parts.append(
            "its gate refuses the restart under way or pending"
            if path
            else "no stop was asked: systemd may start it again"
        )
    elif error is not None:
        parts.append(f"stop failed ({error.reason}): {error}")
    elif job:
        parts.append("stopped it")
    elif stopped:
        parts.append("it was already down")
    else:
        parts.append("systemd control is disabled, the gate alone keeps it down")
    return "; ".join(parts)
