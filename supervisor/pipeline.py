"""source -> tracker -> classifier -> policy, composed once.

The live daemon adds actions and signals around this; `triage` adds printing. Both call the same
`Pipeline.feed`, so what `triage` prints is exactly what the daemon would have decided.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from supervisor.classify import Classifier
from supervisor.config import Config
from supervisor.lifecycle import InvocationTracker
from supervisor.model import Invocation, JournalEntry, Outcome
from supervisor.policy import RestartPolicy
from supervisor.signatures import SignatureTable

Observer = Callable[[Outcome, float], None]
"""Called with each outcome and the seconds its classification took."""


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
    ) -> None:
        self.config = config
        self.tracker = InvocationTracker(config.tracker)
        self.policy = RestartPolicy(policy_state)
        self._observer = observer or (lambda outcome, seconds: None)
        self._clock = clock
        self._classifiers: dict[str | None, Classifier] = {}
        self.table = table
        self._units = frozenset(u.name for u in config.units)

    def reload(self, table: SignatureTable) -> None:
        """Use a new signature table from the next invocation on."""
        self.table = table
        self._classifiers.clear()

    def feed(self, entries: Iterable[JournalEntry]) -> list[Outcome]:
        """Track a batch of entries; return the outcome of every invocation that ended."""
        outcomes: list[Outcome] = []
        units = self._units
        feed = self.tracker.feed
        for entry in entries:
            if units and entry.unit not in units:
                continue
            for invocation in feed(entry):
                outcomes.append(self.decide(invocation))
        return outcomes

    def flush_due(self, now_us: int) -> list[Outcome]:
        """Decide the ended invocations whose late-line window has passed by `now_us`."""
        return [self.decide(inv) for inv in self.tracker.flush_due(now_us)]

    def finish(self) -> list[Outcome]:
        """End every open invocation (the end of a saved journal) and decide about each."""
        return [self.decide(inv) for inv in self.tracker.close_all()]

    def decide(self, invocation: Invocation) -> Outcome:
        """Classify one ended invocation and apply the policy."""
        started = self._clock()
        verdict = self._classifier(invocation.unit).classify(invocation.lines)
        unit = self.config.unit(invocation.unit) if invocation.unit else None
        decision = self.policy.decide(
            invocation,
            verdict,
            unknown_repeat_limit=unit.unknown_repeat_limit if unit else 3,
            dry_run=self.config.is_dry_run(invocation.unit) if invocation.unit else False,
        )
        outcome = Outcome(invocation=invocation, verdict=verdict, decision=decision)
        self._observer(outcome, self._clock() - started)
        return outcome

    def _classifier(self, unit: str | None) -> Classifier:
        classifier = self._classifiers.get(unit)
        if classifier is None:
            sets = self.config.unit(unit).signature_sets if unit else ()
            table = self.table.subset(sets) if sets else self.table
            classifier = Classifier(table, max_line_chars=4096)
            self._classifiers[unit] = classifier
        return classifier
