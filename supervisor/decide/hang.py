"""Hung engines: the engine died but the API server stays up, so systemd never restarts it.

vLLM's API server outlives its EngineCore or a worker (it logs `EngineDeadError`, `Engine core
proc EngineCore_0 died unexpectedly`, ...) and answers every request with 500 while the unit stays
`active`; SGLang's scheduler can log `Scheduler hit an exception` and never exit
(docs/DESIGN.md §2, vllm-project/vllm#48966). No lifecycle message ever comes, so the daemon has to
notice it.

`HangDetector` is pure: it notes each unit's first engine-death line and says when the grace
period has passed without the invocation ending. `HangWatcher` is the daemon's batch hook and
outcome source around it: it sleeps until the next deadline, confirms the hang (the unit is still
`active` per systemd, and the loopback health URL fails) and hands the invocation to the daemon
(`Supervision.end_hung`), which ends it as hung and handles it like any ended invocation: the
shared pipeline decides, the actor acts (a halt for a fatal verdict, a restart otherwise;
supervisor.actions). Nothing here stops or restarts a unit.

The death lines are the engine files' `[[death]]` lists, not the table's `wrapper` signatures:
those also match lines that precede a normal exit (`Received sigquit from a child process`,
TGI's shard errors) and would wait on hangs that never come.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from http import HTTPStatus

import structlog

from ..classify.logline import INFO_LEVELS, parse_line
from ..config import Config
from ..engines.profiles import Engines, follow, hints_of, patterns_of
from ..environment.execstart import serving_port
from ..errors import SystemdError
from ..model import Ended, Evidence, JournalEntry, LifecycleEvent, LogLine, Outcome
from ..seams import Supervision, UnitStates
from ..util.aio import first_of

log = structlog.get_logger(__name__)

# The engine files' [[death]] lines, and a literal that each of them contains (their hints).
DEATH_PATTERNS: tuple[str, ...]
DEATH_HINTS: tuple[str, ...]
_DEATH: re.Pattern[str]


def _death_pattern(patterns: Sequence[str]) -> re.Pattern[str]:
    return re.compile("|".join(f"(?:{p})" for p in patterns) or r"(?!)")


def _use_engines(engines: Engines) -> None:
    """The death lines of the engine files in force (profiles.follow)."""
    global DEATH_PATTERNS, DEATH_HINTS, _DEATH
    DEATH_PATTERNS = patterns_of(engines.death)
    DEATH_HINTS = hints_of(engines.death)
    _DEATH = _death_pattern(DEATH_PATTERNS)


follow(_use_engines)
# PID 1's messages that end an invocation: the journal will report the end, so no hang.
_ENDING = frozenset(
    {
        LifecycleEvent.PROCESS_EXITED.value,
        LifecycleEvent.UNIT_FAILED.value,
        LifecycleEvent.DEACTIVATED.value,
        LifecycleEvent.OOM_KILLED.value,
        LifecycleEvent.CONDITION_SKIPPED.value,
    }
)
HEALTH_TIMEOUT_S = 5.0
RETRY_S = 5.0  # a confirmation that could not be made (systemd did not answer) is retried
# What may stand before a death phrase at the start of a line: a bare level word, and a
# module path before an exception class (`vllm.v1.engine.exceptions.EngineDeadError: ...`).
_QUALIFIER = re.compile(r"^(?:(?:ERROR|CRITICAL|WARNING):?\s+)?(?:[A-Za-z_]\w*\.)*(?=[A-Z])")


@dataclass(slots=True)
class _Death:
    invocation_id: str | None
    host: str | None
    line: str
    due: float


class HangDetector:
    """Notes engine-death lines per unit; `due` names the units whose grace period has passed."""

    def __init__(
        self,
        grace_s: Mapping[str, float],
        *,
        patterns: Sequence[str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._grace = dict(grace_s)
        # Without patterns, the engine files' death lines in force (reloaded with them).
        self._own: tuple[re.Pattern[str], tuple[str, ...]] | None = None
        if patterns is not None:
            # Only the engine files' patterns have known literals; others run the regex alone.
            hints = DEATH_HINTS if tuple(patterns) == DEATH_PATTERNS else ()
            self._own = (_death_pattern(patterns), hints)
        self._clock = clock
        self._deaths: dict[str, _Death] = {}

    def observe_batch(self, batch: list[JournalEntry]) -> None:
        """`observe` each entry; one literal scan of the whole batch when it cannot matter.

        With no death pending nothing can end one, and a batch in which no hint appears at all
        holds no death line: its entries need no look each (the common busy batch)."""
        hints = self._rules()[1]
        if not self._deaths and hints:
            joined = "\n".join([entry.message for entry in batch])
            if not any(hint in joined for hint in hints):
                return
        for entry in batch:
            self.observe(entry)

    def observe(self, entry: JournalEntry) -> None:
        """Note a death line of a supervised unit; forget it when the invocation ends."""
        unit = entry.unit
        if unit is None or unit not in self._grace:
            return
        death = self._deaths.get(unit)
        if death is not None and _ends(entry, death.invocation_id):
            del self._deaths[unit]
            death = None
        if death is None and not entry.from_pid1 and self._may_be_death(entry.message):
            # The grace period runs from when the line was read, not when it was logged: a
            # journal read from its head must not declare a hang before the end is read.
            due = self._clock() + self._grace[unit]
            self._deaths[unit] = _Death(entry.invocation_id, entry.host, entry.message, due)

    def _rules(self) -> tuple[re.Pattern[str], tuple[str, ...]]:
        """The death regex and its literals: the detector's own, or the engine files'."""
        return self._own if self._own is not None else (_DEATH, DEATH_HINTS)

    def _may_be_death(self, message: str) -> bool:
        # Every line of a supervised unit passes here: a literal test rejects nearly all of
        # them before the regex runs (the classifier's prefilter does the same).
        pattern, hints = self._rules()
        if hints:
            for hint in hints:
                if hint in message:
                    break
            else:
                return False
        return is_engine_death(message, pattern)

    def due(self, now: float) -> list[str]:
        """Units whose death line is older than their grace period, invocation not ended."""
        return sorted(u for u, d in self._deaths.items() if d.due <= now)

    def next_due(self) -> float | None:
        """The earliest deadline (clock time), or None when no engine is known to be dead."""
        return min((d.due for d in self._deaths.values()), default=None)

    def death(self, unit: str) -> tuple[str | None, str | None, str] | None:
        """The invocation id, host and death line noted for `unit`."""
        death = self._deaths.get(unit)
        return None if death is None else (death.invocation_id, death.host, death.line)

    def regrace(self, grace_s: Mapping[str, float]) -> None:
        """New units and grace periods; deaths of units no longer supervised are forgotten."""
        self._grace = dict(grace_s)
        for unit in [u for u in self._deaths if u not in self._grace]:
            del self._deaths[unit]

    def postpone(self, unit: str, until: float) -> None:
        """Check `unit` again at `until` (a confirmation could not be made now)."""
        if unit in self._deaths:
            self._deaths[unit].due = until

    def forget(self, unit: str) -> None:
        """Drop the unit's death line (handled, or the engine turned out to be fine)."""
        self._deaths.pop(unit, None)


def is_engine_death(message: str, pattern: re.Pattern[str]) -> bool:
    """True when a death line is the engine's own: it starts the line once its prefixes are
    stripped (optionally as a qualified exception class), and is not logged as information.

    A request log quotes what a client sent (`Received request ...: prompt: '...'`, INFO), so
    a death phrase anywhere else in a line is no evidence of anything."""
    parsed = parse_line(LogLine(text=message))
    if parsed.level in INFO_LEVELS:
        return False
    return pattern.match(_QUALIFIER.sub("", parsed.text.lstrip(), count=1)) is not None


def _ends(entry: JournalEntry, invocation_id: str | None) -> bool:
    """True when `entry` shows the invocation of a noted death has ended."""
    if invocation_id is not None and entry.invocation_id not in (None, invocation_id):
        return True  # a new start: the old one ended even if its end was not logged
    return entry.from_pid1 and entry.message_id in _ENDING


async def health_fails(url: str, *, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """True when the health URL answers non-2xx, times out or cannot be reached."""
    status = await health_status(url, timeout_s=timeout_s)
    return status is None or not HTTPStatus.OK <= status < HTTPStatus.MULTIPLE_CHOICES


class HangWatcher:
    """Confirms hung engines and hands them to the daemon; a batch hook and an outcome source."""

    def __init__(
        self,
        config: Config,
        *,
        systemd: UnitStates | None,
        health: Callable[[str], Awaitable[bool]] = health_fails,
        clock: Callable[[], float] = time.monotonic,
        systemd_timeout_s: float = 10.0,
    ) -> None:
        self.config = config
        self.detector = HangDetector({u.name: u.hang_grace_s for u in config.units}, clock=clock)
        self._systemd = systemd
        self._health = health
        self._clock = clock
        self._systemd_timeout_s = systemd_timeout_s
        self._wake = asyncio.Event()

    def entries(self, batch: list[JournalEntry]) -> list[JournalEntry]:
        """Note death lines; the batch passes unchanged.

        A hung invocation is closed before systemd ends it; the tracker remembers it closed, so
        its last lines and PID 1's messages about its end are dropped there, never a second end.
        """
        before = self.detector.next_due()
        self.detector.observe_batch(batch)
        if self.detector.next_due() != before:
            self._wake.set()
        return batch

    async def evidence(self, ended: Ended, evidence: Evidence) -> Evidence:
        """No evidence of its own (the batch-hook protocol): a hang is the invocation's ending."""
        return evidence

    def reconfigure(self, config: Config) -> None:
        """A reloaded config: its units and their grace periods."""
        self.config = config
        self.detector.regrace({u.name: u.hang_grace_s for u in config.units})

    async def run(self, stop: asyncio.Event, supervision: Supervision) -> None:
        """Sleep until the next grace period ends (or a new death is seen); check due units."""
        while not stop.is_set():
            await self._sleep(stop)
            for unit in self.detector.due(self._clock()):
                await self.check(unit, supervision)

    async def _sleep(self, stop: asyncio.Event) -> None:
        # No death line noted: sleep until `entries` notes one (it sets `_wake`); an idle
        # daemon has no timer of its own.
        due = self.detector.next_due()
        wait = None if due is None else max(0.0, due - self._clock())
        self._wake.clear()
        await first_of(stop.wait(), self._wake.wait(), at_most_s=wait)

    async def check(self, unit: str, supervision: Supervision) -> Outcome | None:
        """Confirm a due unit's hang and hand it over; the outcome, or None when not hung."""
        noted = self.detector.death(unit)
        if noted is None or not supervision.is_open(unit, noted[0]):
            self.detector.forget(unit)
            return None
        if not await self.confirmed(unit):
            return None
        self.detector.forget(unit)
        invocation_id, host, line = noted
        outcome = await supervision.end_hung(unit, host, invocation_id)
        if outcome is None:
            return None
        log.warning(
            "engine_hung",
            unit=unit,
            invocation_id=outcome.invocation.invocation_id,
            death_line=line,
            action=outcome.decision.action.value,
        )
        return outcome

    async def confirmed(self, unit: str) -> bool:
        """The unit is still active (when systemd is used) and the daemon's own probe says the
        server is broken: its configured health URL fails, or, without one, the health route
        on the port it serves (`port`, or read from its ExecStart=) answers 5xx. With neither
        there is no evidence a client could not have written: no hang."""
        if self._systemd is not None and not await self._still_active(self._systemd, unit):
            return False
        configured = self.config.unit(unit).health_url
        if configured is not None:
            if await self._health(configured):
                return True
            log.info("hang_not_confirmed", unit=unit, reason="health_ok")
        else:
            url = await self._serving_health_url(unit)
            status = None if url is None else await health_status(url)
            if status is not None and status >= HTTPStatus.INTERNAL_SERVER_ERROR:
                return True
            log.warning(
                "hang_not_confirmed",
                unit=unit,
                reason=_unconfirmed_reason(url, status),
                action="set the unit's health_url to confirm engine deaths",
            )
        self.detector.forget(unit)
        return False

    async def _still_active(self, systemd: UnitStates, unit: str) -> bool:
        try:
            async with asyncio.timeout(self._systemd_timeout_s):
                state = await systemd.unit_state(unit)
        except (SystemdError, TimeoutError) as exc:
            log.warning("hang_check_failed", unit=unit, error=str(exc) or "timeout")
            self.detector.postpone(unit, self._clock() + RETRY_S)
            return False
        if state.active_state != "active":
            # It is stopping or restarting: the journal will show how it ended.
            log.info("hang_not_confirmed", unit=unit, reason="unit_not_active")
            self.detector.forget(unit)
            return False
        return True

    async def _serving_health_url(self, unit: str) -> str | None:
        """The loopback health route of the port the unit serves, when it can be known."""
        port = self.config.unit(unit).port
        if port is None and self._systemd is not None:
            try:
                async with asyncio.timeout(self._systemd_timeout_s):
                    port = serving_port(await self._systemd.exec_start(unit))
            except (SystemdError, TimeoutError):
                port = None
        return f"http://127.0.0.1:{port}/health" if port else None  # 0: any port, unknown


def _unconfirmed_reason(url: str | None, status: int | None) -> str:
    if url is None:
        return "no health_url, and no serving port known from the config or ExecStart="
    if status is None:
        return f"nothing answered on {url}"
    return f"{url} answered {status}"


async def health_status(url: str, *, timeout_s: float = HEALTH_TIMEOUT_S) -> int | None:
    """The HTTP status a loopback health URL answers, None when nothing answers in time."""
    import httpx  # only when a hang is being confirmed (see notify.webhook on why)

    try:
        async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
            return (await client.get(url)).status_code
    except httpx.HTTPError:
        return None
