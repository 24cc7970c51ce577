"""source -> tracker -> classifier -> (evidence) -> decide, composed once.

`feed` tracks entries and reads the lines of each invocation that ended (`Ended`); the evidence
of each (its phase here, then what the hooks add: the drift, the port's holder) fills one
`Evidence` record; `decide` makes the verdict and the decision from the two, once, and nothing
rewrites them after. The live daemon gathers the evidence in the unit's lane and acts around
this; `triage` gathers the drift the daemon recorded and prints. Both call the same `decide`, so
what `triage` prints is what the daemon decides on the same evidence.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import structlog

from .classify.classifier import Classifier
from .classify.determinism import verdict_of
from .classify.signatures import SignatureTable
from .classify.xid import load_xid_catalog
from .config import Config
from .decide.address_evidence import address_verdict
from .decide.pacing import Schedule
from .decide.policy import RestartPolicy
from .decide.port_evidence import port_verdict
from .decide.xid_evidence import XidEvidence, xid_verdict
from .journal.kernel import KernelLine as KernelLine  # what gpu_faults takes
from .model import (
    NO_FACTS,
    Ended,
    Ending,
    Evidence,
    Invocation,
    JournalEntry,
    Outcome,
    Severity,
    Verdict,
    phase_of,
)
from .track.tracker import Drained as Drained  # what `due` takes
from .track.tracker import InvocationTracker
from .track.tracker import Now as Now
from .track.tracker import SuppressionNotice as SuppressionNotice  # what take_notices returns

Observer = Callable[[Outcome, float], None]
"""Called with each outcome and the seconds its classification took."""

Provider = Callable[[Ended, Evidence], Evidence]
"""Adds what it knows to an ended invocation's evidence, at once (triage's recorded drift)."""

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
        on_skip: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.tracker = InvocationTracker(config.tracker)
        self.policy = RestartPolicy(policy_state)
        self._observer = observer or (lambda outcome, seconds: None)
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
            if self._units:  # none: every unit is read (triage of a saved journal)
                self.tracker.forget_all_but(self._units)
        self._classifiers.clear()

    def feed(self, entries: Iterable[JournalEntry]) -> list[Ended]:
        """Track a batch of entries; every invocation that ended, its lines read.

        Total by construction (the tracker and classifier never raise on content); as a last
        guard an entry whose handling raises anyway is logged with its cursor, counted in
        `skipped_entries` and skipped: journal content never stops supervision.
        """
        ended: list[Ended] = []
        units = self._units
        feed = self.tracker.feed
        for entry in entries:
            if units and entry.unit not in units:
                continue
            try:
                invocations = feed(entry)
            except Exception as exc:
                self._skipped(entry, exc)
                continue
            for invocation in invocations:
                ended.append(self.examine(invocation))
        return ended

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

    def due(self, now: Now, drained: Drained | None = None) -> list[Ended]:
        """The ended invocations whose wait for their late lines is over at `now`, or whose
        host drained (supervisor.track.settle), their lines read."""
        return [self.examine(inv) for inv in self.tracker.due(now, drained)]

    def close_hung(self, unit: str, host: str | None, invocation_id: str | None) -> Ended | None:
        """End the open invocation as hung (its engine died, the unit stays up); None when it
        is not open."""
        invocation = self.tracker.close(unit, host, invocation_id, Ending.HUNG)
        return None if invocation is None else self.examine(invocation)

    def close_remaining(
        self, unit: str, host: str | None, invocation_id: str | None
    ) -> Ended | None:
        """End the open invocation whose server exited while the unit stays active
        (RemainAfterExit=yes: nothing in the journal ends it); None when it is not open."""
        invocation = self.tracker.close(
            unit,
            host,
            invocation_id,
            Ending.EXITED,
            end_message="its main process exited; the unit stays active (exited) "
            "under RemainAfterExit=yes",
        )
        return None if invocation is None else self.examine(invocation)

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

    def newest_invocation_id(self, unit: str | None, host: str | None = None) -> str | None:
        """The id of `unit`'s newest invocation read (on `host`), ended or not."""
        return self.tracker.newest_invocation_id(unit, host)

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

    def finish(self) -> list[Ended]:
        """End every open invocation (the end of a saved journal)."""
        return [self.examine(inv) for inv in self.tracker.close_all()]

    def examine(self, invocation: Invocation) -> Ended:
        """Read an ended invocation's lines (the classifier); a reading that raises is logged,
        counted, and becomes an unclassified crash."""
        started = self._clock()
        try:
            reading, facts = self._classifier(invocation.unit).examine(invocation)
        except Exception as exc:
            self._unclassified(invocation, exc)
            reading, facts = _unclassified(invocation, exc), NO_FACTS
        return Ended(
            invocation=invocation, reading=reading, facts=facts, examined_s=self._clock() - started
        )

    def evidence(self, ended: Ended) -> Evidence:
        """The evidence record of an ended invocation, its phase filled in (the hooks add
        theirs: supervisor.seams.BatchHook.evidence)."""
        good_start_s = self.config.drift.good_start_s
        return Evidence(phase=phase_of(ended.invocation, good_start_s, ended.reading.phase_hint))

    def decide(self, ended: Ended, evidence: Evidence) -> Outcome:
        """The verdict and the decision of an ended invocation, from its reading and the
        evidence gathered before: the one decision, for the daemon and for `triage`. Pure but
        for the policy's memory of the unit's streak, which it updates."""
        started = self._clock()
        invocation = ended.invocation
        unit = self.config.unit(invocation.unit) if invocation.unit else None
        halt_inferred = unit.halt_inferred if unit else True
        try:
            verdict = verdict_of(
                self._classifier(invocation.unit),
                ended.reading,
                ended.facts,
                invocation,
                evidence.phase,
                evidence.drift,
            )
        except Exception as exc:
            self._unclassified(invocation, exc)
            verdict = _unclassified(invocation, exc)
        verdict = port_verdict(
            verdict, evidence.port, invocation.unit or "", halt_inferred=halt_inferred
        )
        verdict = address_verdict(verdict, evidence.address, halt_inferred=halt_inferred)
        verdict = xid_verdict(verdict, evidence.xid)
        decision = self.policy.decide(
            invocation,
            verdict,
            evidence,
            unknown_repeat_limit=unit.unknown_repeat_limit if unit else 3,
            halt_inferred=halt_inferred,
            repeat_window_s=unit.repeat_window_s if unit else 120.0,
            schedule=Schedule(
                first_s=unit.pace_first_s, max_s=unit.pace_max_s, reset_s=unit.pace_reset_s
            )
            if unit
            else None,
            dry_run=self.config.is_dry_run(invocation.unit) if invocation.unit else False,
        )
        outcome = Outcome(
            invocation=invocation, verdict=verdict, decision=decision, drift=evidence.drift
        )
        self._observer(outcome, ended.examined_s + self._clock() - started)
        return outcome

    def gpu_faults(self, lines: Iterable[KernelLine]) -> Provider:
        """For `triage`: the kernel's driver lines of a saved journal, joined to its crashes as
        the daemon joins them (supervisor.decide.xid_evidence)."""
        xids = XidEvidence(load_xid_catalog())
        xids.note_all(lines)
        return xids.joined

    def decide_all(
        self, ended: Iterable[Ended], providers: Sequence[Provider] = ()
    ) -> list[Outcome]:
        """Each ended invocation decided on its evidence: its phase, then what `providers`
        add at once (`triage`: the drift the daemon recorded)."""
        outcomes = []
        for one in ended:
            evidence = self.evidence(one)
            for provide in providers:
                evidence = provide(one, evidence)
            outcomes.append(self.decide(one, evidence))
        return outcomes

    def _unclassified(self, invocation: Invocation, exc: Exception) -> None:
        self.skipped_entries += 1
        self._on_skip()
        log.error(
            "classification_failed",
            unit=invocation.unit,
            invocation_id=invocation.invocation_id,
            cursor=invocation.last_cursor,
            error=f"{type(exc).__name__}: {exc}",
        )

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


def _unclassified(invocation: Invocation, exc: Exception) -> Verdict:
    """The verdict of an invocation whose lines could not be read (a bug, logged)."""
    return Verdict(
        signature=None,
        severity=Severity.UNKNOWN,
        title="Unclassified crash",
        root_cause=None,
        crashed=invocation.failed,
        notes=(f"classification failed: {type(exc).__name__}",),
    )
