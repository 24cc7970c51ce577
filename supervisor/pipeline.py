"""source -> tracker -> classifier -> policy, composed once.

The live daemon adds actions and signals around this; `triage` adds printing. Both call the same
`Pipeline.feed`, so what `triage` prints is exactly what the daemon would have decided.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from .classify.classifier import Classifier
from .classify.determinism import judge, phase_of
from .classify.signatures import SignatureTable
from .config import Config
from .decide.policy import RestartPolicy
from .model import Ending, Invocation, JournalEntry, Outcome, Severity, Verdict
from .track.tracker import InvocationTracker
from .track.tracker import SuppressionNotice as SuppressionNotice  # what take_notices returns

Observer = Callable[[Outcome, float], None]
"""Called with each outcome and the seconds its classification took."""

DriftLookup = Callable[[str, str], list[str]]
"""What changed in a unit's environment since its last good start, for an invocation."""

log = structlog.get_logger(__name__)


class Pipeline:
    """Tracks invocations of the configured units and decides about each one that ends."""

    def __init__(
        self,
        config: Config,
        table: SignatureTable,
        *,
        policy_state: dict[str, dict[str, Any]] | None = None,
        observer: Observer | None = None,
        clock: Callable[[], float] = time.perf_counter,
        drift: DriftLookup | None = None,
        on_skip: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.tracker = InvocationTracker(config.tracker)
        self.policy = RestartPolicy(policy_state)
        self._observer = observer or (lambda outcome, seconds: None)
        # Set by supervisor.environment.drift when the daemon records environments: a crash
        # no signature knows, right after the environment changed, is inferred fatal
        # (determinism.assess).
        self.drift = drift
        self._clock = clock
        self._classifiers: dict[str | None, Classifier] = {}
        self.table = table
        self._units = frozenset(u.name for u in config.units)
        self.skipped_entries = 0  # entries or invocations whose handling raised (logged)
        self._on_skip = on_skip or (lambda: None)  # the daemon counts them in a metric

    def reload(self, table: SignatureTable, config: Config | None = None) -> None:
        """Use a new signature table (and config: units, per-unit settings) from now on."""
        self.table = table
        if config is not None:
            self.config = config
            self._units = frozenset(u.name for u in config.units)
        self._classifiers.clear()

    def feed(self, entries: Iterable[JournalEntry]) -> list[Outcome]:
        """Track a batch of entries; return the outcome of every invocation that ended.

        Total by construction (the tracker, classifier and policy never raise on content); as
        a last guard an entry whose handling raises anyway is logged with its cursor, counted
        in `skipped_entries` and skipped: journal content never stops supervision.
        """
        outcomes: list[Outcome] = []
        units = self._units
        feed = self.tracker.feed
        for entry in entries:
            if units and entry.unit not in units:
                continue
            try:
                ended = feed(entry)
            except Exception as exc:
                self._skipped(entry, exc)
                continue
            for invocation in ended:
                outcomes.append(self.decide(invocation))
        return outcomes

    def replay(self, entry: JournalEntry) -> None:
        """Track an entry read again after a restart, up to the saved cursor: it only rebuilds
        the open invocation, nothing ended by it is decided again. Guarded as `feed` is."""
        if self._units and entry.unit not in self._units:
            return
        try:
            self.tracker.feed(entry)
        except Exception as exc:
            self._skipped(entry, exc)

    def _skipped(self, entry: JournalEntry, exc: Exception) -> None:
        self.skipped_entries += 1
        self._on_skip()
        log.error(
            "entry_skipped",
            cursor=entry.cursor,
            unit=entry.unit,
            error=f"{type(exc).__name__}: {exc}",
            action="this entry was skipped; supervision goes on",
        )

    def flush_due(self, now_us: int) -> list[Outcome]:
        """Decide the ended invocations whose late-line window has passed by journal time."""
        return [self.decide(inv) for inv in self.tracker.flush_due(now_us)]

    def flush_quiet(self) -> list[Outcome]:
        """Decide the ended invocations whose late-line window has passed (a quiet journal)."""
        return [self.decide(inv) for inv in self.tracker.flush_quiet()]

    def flush_drained(self, host: str, read_before: float) -> list[Outcome]:
        """Decide `host`'s ended invocations whose late lines are known to be read (the daemon
        asked journald's streams and the reader; see InvocationTracker.flush_drained)."""
        return [self.decide(inv) for inv in self.tracker.flush_drained(host, read_before)]

    def close_hung(self, unit: str, host: str | None, invocation_id: str | None) -> Outcome | None:
        """End the open invocation as hung (its engine died, the unit stays up) and decide it;
        None when it is not open."""
        invocation = self.tracker.close(unit, host, invocation_id, Ending.HUNG)
        return None if invocation is None else self.decide(invocation)

    def close_remaining(
        self, unit: str, host: str | None, invocation_id: str | None
    ) -> Outcome | None:
        """End the open invocation whose server exited while the unit stays active
        (RemainAfterExit=yes: nothing in the journal ends it) and decide it; None when it is
        not open."""
        invocation = self.tracker.close(unit, host, invocation_id, Ending.EXITED)
        if invocation is None:
            return None
        invocation = dataclasses.replace(
            invocation,
            end_message="its main process exited; the unit stays active (exited) "
            "under RemainAfterExit=yes",
        )
        return self.decide(invocation)

    def next_deadline(self) -> float | None:
        """When the next ended invocation's late-line window ends (monotonic); None if none."""
        return self.tracker.next_deadline()

    def supervises(self, unit: str) -> bool:
        """True when `unit` is one of the configured units."""
        return unit in self._units

    def settling(self, unit: str | None) -> bool:
        """True while an ended invocation of `unit` waits for its late lines."""
        return self.tracker.settling(unit)

    def settling_on(self, host: str) -> bool:
        """True while an ended invocation of `host` waits for its late lines."""
        return self.tracker.settling_on(host)

    def has_seen(self, unit: str | None, invocation_id: str) -> bool:
        """True once `unit`'s invocation `invocation_id` was read."""
        return self.tracker.has_seen(unit, invocation_id)

    def open_invocation(self, unit: str | None, host: str | None = None) -> Invocation | None:
        """`unit`'s invocation that has not ended (on `host`), if any."""
        return self.tracker.open_invocation(unit, host)

    def take_notices(self) -> list[SuppressionNotice]:
        """journald's late word that it dropped lines of invocations already decided."""
        return self.tracker.take_notices()

    def replay_from(self) -> str | None:
        """The first entry of the oldest invocation still open: where a restart reads again."""
        return self.tracker.replay_from()

    def memory(self) -> dict[str, dict[str, Any]]:
        """The policy's memory of each unit (a copy), for the state database."""
        return self.policy.state()

    def forget(self, unit: str) -> None:
        """Drop what the policy remembers of `unit` (after `release`)."""
        self.policy.forget(unit)

    def finish(self) -> list[Outcome]:
        """End every open invocation (the end of a saved journal) and decide about each."""
        return [self.decide(inv) for inv in self.tracker.close_all()]

    def decide(self, invocation: Invocation) -> Outcome:
        """Classify one ended invocation and apply the policy."""
        started = self._clock()
        unit = self.config.unit(invocation.unit) if invocation.unit else None
        drift = self._drift_of(invocation)
        good_start_s = self.config.drift.good_start_s
        try:
            classifier = self._classifier(invocation.unit)
            verdict, phase = judge(classifier, invocation, good_start_s, drift)
        except Exception as exc:
            self.skipped_entries += 1
            self._on_skip()
            log.error(
                "classification_failed",
                unit=invocation.unit,
                invocation_id=invocation.invocation_id,
                cursor=invocation.last_cursor,
                error=f"{type(exc).__name__}: {exc}",
            )
            verdict = Verdict(
                signature=None,
                severity=Severity.UNKNOWN,
                title="Unclassified crash",
                root_cause=None,
                crashed=invocation.failed,
                notes=(f"classification failed: {type(exc).__name__}",),
            )
            phase = phase_of(invocation, good_start_s)
        decision = self.policy.decide(
            invocation,
            verdict,
            phase,
            unknown_repeat_limit=unit.unknown_repeat_limit if unit else 3,
            halt_inferred=unit.halt_inferred if unit else True,
            repeat_window_s=unit.repeat_window_s if unit else 120.0,
            dry_run=self.config.is_dry_run(invocation.unit) if invocation.unit else False,
        )
        outcome = Outcome(
            invocation=invocation, verdict=verdict, decision=decision, drift=tuple(drift)
        )
        self._observer(outcome, self._clock() - started)
        return outcome

    def _drift_of(self, invocation: Invocation) -> list[str]:
        """The environment's changes since the unit's last good start (none without a log)."""
        if self.drift is None or invocation.unit is None or invocation.invocation_id is None:
            return []
        if not invocation.failed:
            return []
        try:
            return self.drift(invocation.unit, invocation.invocation_id)
        except Exception as exc:
            log.warning("drift_lookup_failed", unit=invocation.unit, error=str(exc))
            return []

    def _classifier(self, unit: str | None) -> Classifier:
        classifier = self._classifiers.get(unit)
        if classifier is None:
            sets = self.config.unit(unit).signature_sets if unit else ()
            table = self.table.subset(sets) if sets else self.table
            classifier = Classifier(
                table, max_line_chars=4096, cause_window_s=self.config.tracker.cause_window_s
            )
            self._classifiers[unit] = classifier
        return classifier
