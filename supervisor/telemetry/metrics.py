"""Every Prometheus series the supervisor exports, declared in one place.

`Metrics(registry)` receives its `CollectorRegistry` (tests use a fresh one) and pre-creates each
series whose labels are known, so a rate() or an alert sees 0 before the first event (the idea of
Alertmanager's `InitializeFor`). A supervised unit's ~160 series are created once systemd says
it has the unit, or cannot say, or once the unit has something to report; a unit systemd does
not know (LoadState=not-found: not installed here, or a typo) exports only `unit_present 0`.
Label values come only from bounded sets: configured units, signature ids of the loaded table,
enums and code-defined reasons. Anything else becomes "unknown" or "other", never raw text. This
is the only module that imports prometheus_client.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

# This module is the one place allowed to use prometheus_client (ruff TID251 bans it elsewhere).
from prometheus_client import (  # noqa: TID251
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import (  # noqa: TID251
    CONTENT_TYPE_PLAIN_0_0_4,
    generate_latest,
)

from .. import __version__
from ..engines.schema import PHASES
from ..fleet import proof_of
from ..model import HALT_RULES, Action, Outcome, Rule, Severity

# `*_created` gauges double every counter's series and nothing of ours reads them. This is
# process-wide, which is acceptable because no other module may use prometheus_client.
disable_created_metrics()  # type: ignore[no-untyped-call]

PREFIX = "vllm_supervisor_"
UNKNOWN = "unknown"
OTHER = "other"

NOTIFICATION_OUTCOMES = ("queued", "grouped", "sent", "retried", "failed", "dropped", "folded")
"""Values of the `outcome` label of `vllm_supervisor_notifications_total`."""
DROP_SINKS = ("slack", "alertmanager")
"""Sinks whose series exist from the start; any other sink's once it is built (`sink`)."""
_SINK_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")  # sinks are named in code, never by input
DROP_REASONS = ("invalid_url", "http_4xx", "unrenderable", "attempts_exhausted", "other")
"""Labels of `vllm_supervisor_notifications_dropped_total`: messages given up for good."""

SOURCE_RESTART_REASONS = ("exited", "no_output", "error", "other")
ENTRY_INVALID_REASONS = ("unparsable_entry", "invalid_json", "pipeline_error", "other")
HALT_REASONS = tuple(rule.value for rule in HALT_RULES)
MAX_GPUS = 64  # PCI addresses with a series of their own
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")  # a crash's (supervisor.classify.fingerprint)
# The results of a fleet lookup (supervisor.decide.fleet).
FLEET_RESULTS = ("proof", "none", "unreachable", "no_environment")
# A start to serving: an 8B model in a minute, a large MoE in 10-20 (weights, compile, graphs).
_START_BUCKETS = (30, 60, 90, 120, 180, 300, 450, 600, 900, 1200, 1800, 2700, 3600, 5400, 7200)
HALT_FAILED_REASONS = (
    "timeout",
    "access_denied",
    "no_such_unit",
    "bus_unavailable",
    "dbus_error",
    "quarantine",
    "other",
)
STATE_ERROR_REASONS = ("commit_failed", "read", "write", "other")
SNAPSHOT_OUTCOMES = ("recorded", "failed", "no_interpreter")
"""Values of the `outcome` label of `vllm_supervisor_environment_snapshots_total`."""
# Per-signature series created at 0 for the units, per family (see _zero_signature_series):
# 74 units of the shipped table (135 signatures), more than the 64 units labelled before.
SIGNATURE_SERIES_MAX = 10_000
MAX_UNITS = 64  # units seen in the journal but never configured get a label up to this many

# A code-defined reason: short snake_case. Everything else is folded into "other".
_REASON = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
_UNIT = re.compile(r"^[A-Za-z0-9:_.@\\-]{1,255}$")
_SIGNATURE = re.compile(r"^[A-Za-z0-9_.:-]{1,80}$")

_LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_CLASSIFY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class Metrics:
    """The supervisor's metrics on an injected registry; one method per thing that happened."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.registry = registry if registry is not None else new_registry()
        self._now = now
        self._units: set[str] = set()  # the units whose series exist
        self._supervised: set[str] = set()
        self._supervised_labelled = 0  # of `_units`, those configured (not under MAX_UNITS)
        self._signature_series_units: set[str] = set()  # see _zero_signature_series
        self._signatures: set[str] = set()
        self._severities: dict[str, str] = {}
        self.is_following = False
        self.lag_s: float | None = None  # the last journal lag, for /healthz
        self._declare_journal()
        self._declare_crashes()
        self._declare_actions()
        self._declare_state()
        self._init_reasons()

    # -- declarations -------------------------------------------------------------------------

    def _counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(PREFIX + name, doc, labelnames=labels, registry=self.registry)

    def _gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(PREFIX + name, doc, labelnames=labels, registry=self.registry)

    def _declare_journal(self) -> None:
        self._build = self._gauge("build_info", "Version of the running supervisor.", ["version"])
        self._build.labels(__version__).set(1)
        self._entries = self._counter("journal_entries_total", "Journal entries read.")
        self._lag = self._gauge(
            "journal_lag_seconds", "Age of the newest journal entry read, at the time it was read."
        )
        self._following = self._gauge(
            "journal_following", "1 while the journal source follows the journal, else 0."
        )
        self._source_restarts = self._counter(
            "journal_source_restarts_total", "Restarts of the journal reader.", ["reason"]
        )
        self._invalid = self._counter(
            "journal_entries_invalid_total", "Journal entries skipped as invalid.", ["reason"]
        )
        self._suppressed = self._counter(
            "journal_lines_suppressed_total",
            "Lines of a unit that journald's rate limit dropped (its 'Suppressed N messages').",
            ["unit"],
        )
        self._gpu_xid = self._counter(
            "gpu_xid_total",
            "NVIDIA Xid faults the kernel logged, per GPU (PCI address) and Xid (one the Xid "
            "catalog lists, else 'other'), whether or not an engine crashed.",
            ["pci", "xid"],
        )
        self._gpus: set[str] = set()
        self._fleet = self._counter(
            "fleet_lookups_total",
            "Crashes whose decision asked the fleet's Alertmanager for another host's halt of "
            "the same crash and environment, by result: proof (one applied), none, "
            "unreachable (an error or no answer within fleet.timeout_s: decided locally), "
            "no_environment (this unit's environment could not be read).",
            ["result"],
        )
        for result in FLEET_RESULTS:
            self._fleet.labels(result)
        self._cursor_gaps = self._counter(
            "journal_cursor_gaps_total",
            "Resumes whose saved cursor's entry was gone (vacuumed): reading went on at the "
            "oldest entry after it.",
        )
        self._reader_failures = self._gauge(
            "journal_reader_failures",
            "Starts of the journal reader child in a row that failed (0 once it hands over "
            "entries), read at each scrape: 3 or more and nothing is read or decided.",
        )
        self._reader_memory = self._gauge(
            "journal_reader_memory_bytes",
            "Resident memory of the journal reader child (its VmRSS), read at each scrape; "
            "0 while no child runs.",
        )

    def _declare_crashes(self) -> None:
        self._present = self._gauge(
            "unit_present",
            "1 when systemd has the supervised unit, 0 when it has no such unit "
            "(LoadState=not-found; then this is the unit's only series); absent until asked.",
            ["unit"],
        )
        self._crashes = self._counter(
            "crashes_total",
            "Ended invocations classified as crashes.",
            ["unit", "signature", "severity"],
        )
        self._restarts = self._gauge(
            "unit_restarts", "systemd's restart counter of the unit, as last seen.", ["unit"]
        )
        self._last_crash = self._gauge(
            "last_crash_timestamp_seconds", "Unix time of the unit's last crash.", ["unit"]
        )
        self._decisions = self._counter(
            "decisions_total",
            "Policy decisions about ended invocations (dry_run: decided but never acted on).",
            ["unit", "signature", "action", "dry_run"],
        )
        self._classify = Histogram(
            PREFIX + "classify_duration_seconds",
            "Time to classify one ended invocation.",
            buckets=_CLASSIFY_BUCKETS,
            registry=self.registry,
        )
        self._sig_loaded = self._gauge(
            "signature_table_loaded", "1 when the signature table loaded, else 0."
        )
        self._sig_count = self._gauge(
            "signature_table_signatures", "Signatures in the loaded table."
        )

    def _declare_actions(self) -> None:
        self._halts = self._counter("halts_total", "Units halted.", ["unit", "reason"])
        self._halt_failures = self._counter(
            "halt_failures_total", "Halts that failed.", ["unit", "reason"]
        )
        self._loop_lag = Histogram(
            PREFIX + "event_loop_lag_seconds",
            "How late the event loop ran a timer while the daemon was busy (sampled every "
            "100 ms for a second after each batch): what a blocking call costs everything else.",
            buckets=_LOOP_LAG_BUCKETS,
            registry=self.registry,
        )
        self._halt_latency = Histogram(
            PREFIX + "halt_latency_seconds",
            "Time from the end of the crashed invocation to the unit being halted.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._to_serving = Histogram(
            PREFIX + "start_to_serving_seconds",
            "Time from a unit's start (PID 1's) to its first serving line: each unit's own "
            "usual start, which VllmSupervisorStartStalled compares a running start with.",
            ["unit"],
            buckets=_START_BUCKETS,
            registry=self.registry,
        )
        self._timed_starts: dict[str, int] = {}  # unit -> the start last observed, microseconds
        self._halted = self._gauge(
            "unit_halted", "1 while the unit is quarantined by the supervisor.", ["unit"]
        )
        self._halted_crash = self._gauge(
            "unit_halted_crash",
            "1 per halted unit whose halt the fleet shares: the crash's fingerprint, and proof "
            "'own' (halted on this host's evidence) or 'fleet' (on another host's proof). One "
            "series per halted unit at most; the fleet view sums it by crash.",
            ["unit", "crash", "proof"],
        )
        self._holds = self._counter(
            "holds_total",
            "Starts held by pacing (a crash loop neither proven fatal nor serving), by the rule "
            "that allowed the restart.",
            ["unit", "rule"],
        )
        self._held_until = self._gauge(
            "unit_held_until_timestamp_seconds",
            "Unix time the unit's held start runs (systemd's timer starts it then); 0 while "
            "no start is held. Read from the hold records at each scrape.",
            ["unit"],
        )
        self._start = self._gauge(
            "unit_start_timestamp_seconds",
            "Unix time PID 1 started the unit's running invocation; 0 while none runs, its "
            "start was not read (the daemon came up after it) or a reload removed the unit.",
            ["unit"],
        )
        self._serving = self._gauge(
            "unit_serving",
            "1 once the unit's running invocation printed its engine's serving line, else 0.",
            ["unit"],
        )
        self._phase = self._gauge(
            "unit_start_phase",
            "1 for the phase of its start (an engine file's [[phase]]: download, weights, "
            "compile, kv_cache, cuda_graphs, ...) the unit's running invocation last named, "
            "while it does not serve yet; no series otherwise. The stalled-start alert says it.",
            ["unit", "phase"],
        )
        self._hung = self._counter(
            "hung_engines_total",
            "Invocations closed as hung (engine dead, unit still active), by the action taken.",
            ["unit", "action"],
        )
        self._snapshots = self._counter(
            "environment_snapshots_total",
            "Environment snapshots at unit starts, by outcome (for drift reports).",
            ["unit", "outcome"],
        )
        self._notifications = self._counter(
            "notifications_total", "Notifications by sink and outcome.", ["sink", "outcome"]
        )
        self._outbox = self._gauge(
            "outbox_depth", "Notifications waiting for delivery, by sink.", ["sink"]
        )
        self._dropped = self._counter(
            "notifications_dropped_total",
            "Notifications given up for good, by sink and reason: an unusable URL, a 4xx, a "
            "message that cannot be rendered, or attempts exhausted (never retried again).",
            ["sink", "reason"],
        )

    def _declare_state(self) -> None:
        self._state_errors = self._counter(
            "state_errors_total", "Failures of the state database.", ["reason"]
        )

    def _init_reasons(self) -> None:
        for reason in SOURCE_RESTART_REASONS:
            self._source_restarts.labels(reason)
        for reason in ENTRY_INVALID_REASONS:
            self._invalid.labels(reason)
        for sink in DROP_SINKS:
            self.sink(sink)
        for reason in STATE_ERROR_REASONS:
            self._state_errors.labels(reason)
        self._init_unit(UNKNOWN)

    # -- bounded label values -----------------------------------------------------------------

    def _unit(self, unit: str | None) -> str:
        """A unit label: registered units, or a valid unit name while under the cap."""
        if unit is None:
            return UNKNOWN
        if unit in self._units:
            return unit
        if unit in self._supervised:
            self._init_unit(unit)  # configured: bounded by the config, never capped
            return unit
        if _UNIT.match(unit) and len(self._units) - self._supervised_labelled < MAX_UNITS:
            self._init_unit(unit)
            return unit
        return OTHER

    def _signature(self, signature: str | None) -> str:
        """A signature label: an id of the loaded table; "unknown" for none; else "other"."""
        if signature is None:
            return UNKNOWN
        if signature in self._signatures:
            return signature
        if not self._signatures and _SIGNATURE.match(signature):
            return signature  # no table registered (e.g. in a test): ids are still code-bounded
        return OTHER

    @staticmethod
    def _reason(reason: str, known: Iterable[str] = ()) -> str:
        return reason if reason in known or _REASON.match(reason) else OTHER

    def _zero_signature_series(self, unit: str) -> bool:
        """Are `unit`'s per-signature series created at 0 (for increase() and the alerts)?
        Up to SIGNATURE_SERIES_MAX of them per family, units in the order they came: 500
        units of the shipped table made 150k series, a 17.7 MB scrape taking 1.6 s of CPU,
        and 0.19 MB a unit. Past it, a unit's series appear with its first crash."""
        if unit in self._signature_series_units:
            return True
        needed = (len(self._signature_series_units) + 1) * max(1, len(self._signatures))
        if needed > SIGNATURE_SERIES_MAX:
            return False
        self._signature_series_units.add(unit)
        return True

    def _init_unit(self, unit: str) -> None:
        if unit not in self._units and unit in self._supervised:
            self._supervised_labelled += 1
        self._units.add(unit)
        self._crashes.labels(unit, UNKNOWN, Severity.UNKNOWN.value)
        if self._zero_signature_series(unit):
            for signature, severity in self._severities.items():
                self._crashes.labels(unit, signature, severity)
            for signature in self._signatures:
                # Real halts per signature: the fleet alert's increase() needs the series at 0.
                self._decisions.labels(unit, signature, Action.HALT.value, "false")
        for action in Action:
            for dry in ("false", "true"):
                self._decisions.labels(unit, UNKNOWN, action.value, dry)
        if unit == UNKNOWN:
            return
        self._suppressed.labels(unit)
        self._halted.labels(unit).set(0)
        self._start.labels(unit).set(0)
        self._serving.labels(unit).set(0)
        for reason in HALT_REASONS:
            self._halts.labels(unit, reason)
        for reason in HALT_FAILED_REASONS:
            self._halt_failures.labels(unit, reason)
        for action in Action:
            self._hung.labels(unit, action.value)
        for snapshot in SNAPSHOT_OUTCOMES:
            self._snapshots.labels(unit, snapshot)

    # -- the daemon's calls ---------------------------------------------------------------------

    def register_units(self, units: Iterable[str]) -> None:
        """Remember the supervised units; their series come with `unit_loaded` or a report."""
        self._supervised = {unit for unit in units if _UNIT.match(unit)}
        self._supervised_labelled = len(self._units & self._supervised)

    def unit_loaded(self, unit: str, loaded: bool | None) -> None:
        """What systemd says of a supervised unit: it has it (True), it has no such unit
        (False: `unit_present 0` only), or nothing (None: it could not be asked). Every
        per-unit series is created at 0 unless the unit is known to be absent."""
        if unit not in self._supervised:
            return
        if loaded is not None:
            self._present.labels(unit).set(1 if loaded else 0)
        if loaded is not False:
            self._unit(unit)

    def signature_table(
        self,
        ids: Sequence[str],
        loaded: bool,
        *,
        severities: Mapping[str, str] | None = None,
    ) -> None:
        """Record the loaded signature table; its ids become the allowed `signature` labels."""
        self._signatures = set(ids)
        self._severities = dict(severities or {})
        self._sig_loaded.set(1 if loaded else 0)
        self._sig_count.set(len(ids))
        self._signature_series_units = set()
        for unit in list(self._units):
            self._init_unit(unit)

    def reader_failures(self, failures: Callable[[], int]) -> None:
        """Read the reader's failed starts in a row with `failures` at each scrape."""
        self._reader_failures.set_function(lambda: float(failures()))

    def reader_memory(self, resident_bytes: Callable[[], int | None]) -> None:
        """Read the journal reader child's memory with `resident_bytes` at each scrape."""
        self._reader_memory.set_function(lambda: float(resident_bytes() or 0))

    def entries_read(self, count: int) -> None:
        """Count journal entries read."""
        self._entries.inc(count)

    def loop_lag(self, seconds: float) -> None:
        """Record one event-loop lag sample."""
        self._loop_lag.observe(max(0.0, seconds))

    def journal_lag(self, seconds: float) -> None:
        """Record how far behind the journal's newest entry the reader is."""
        self.lag_s = max(0.0, seconds)
        self._lag.set(self.lag_s)

    def following(self, is_following: bool) -> None:
        """Record whether the journal is being followed (feeds /healthz too)."""
        self.is_following = is_following
        self._following.set(1 if is_following else 0)

    def source_restart(self, reason: str) -> None:
        """Count a restart of the journal reader."""
        self._source_restarts.labels(self._reason(reason, SOURCE_RESTART_REASONS)).inc()

    def entry_invalid(self, reason: str) -> None:
        """Count a journal entry that could not be decoded."""
        self._invalid.labels(self._reason(reason, ENTRY_INVALID_REASONS)).inc()

    def cursor_gap(self) -> None:
        """Count a resume that found the saved cursor's entry vacuumed."""
        self._cursor_gaps.inc()

    def outcome(self, outcome: Outcome, classify_seconds: float) -> None:
        """Record one ended invocation: crash, restart counter, decision, classify time."""
        inv, verdict, decision = outcome.invocation, outcome.verdict, outcome.decision
        unit = self._unit(inv.unit)
        signature = self._signature(verdict.signature)
        self._classify.observe(max(0.0, classify_seconds))
        if inv.failed or verdict.crashed:
            self._crashes.labels(unit, signature, verdict.severity.value).inc()
            self._last_crash.labels(unit).set(_seconds(inv.ended_us) or self._now())
        if inv.restarts is not None:
            self._restarts.labels(unit).set(inv.restarts)
        if inv.start_seen:
            self.start_served(inv.unit, inv.started_us, inv.served_us)
        dry = "true" if decision.dry_run else "false"
        self._decisions.labels(unit, signature, decision.action.value, dry).inc()

    def halt(self, unit: str, rule: Rule, latency_seconds: float) -> None:
        """Count a halted unit and how long halting took after the crash."""
        label = self._unit(unit)
        self._halts.labels(label, rule.value if rule in HALT_RULES else OTHER).inc()
        self._halt_latency.observe(max(0.0, latency_seconds))
        self._halted.labels(label).set(1)

    def halt_failed(self, unit: str, reason: str) -> None:
        """Count a halt that failed."""
        self._halt_failures.labels(
            self._unit(unit), self._reason(reason, HALT_FAILED_REASONS)
        ).inc()

    def engine_hung(self, unit: str, action: Action) -> None:
        """Count an invocation closed as hung, with the action the policy chose."""
        self._hung.labels(self._unit(unit), action.value).inc()

    def environment_snapshot(self, unit: str, outcome: str) -> None:
        """Count an environment snapshot at a start: recorded, failed or no_interpreter."""
        label = outcome if outcome in SNAPSHOT_OUTCOMES else OTHER
        self._snapshots.labels(self._unit(unit), label).inc()

    def units_halted(self, unit: str, halted: bool) -> None:
        """Set whether a unit is quarantined (at start-up, on halt, on release)."""
        self._halted.labels(self._unit(unit)).set(1 if halted else 0)

    def held(self, unit: str, rule: Rule, until: float) -> None:
        """Count a held start and show its time."""
        label = self._unit(unit)
        self._holds.labels(label, rule.value).inc()
        self._held_until.labels(label).set(until)

    def held_units(self, holds: Mapping[str, float], now: float) -> None:
        """Set `unit_held_until_timestamp_seconds` of every known unit from the holds that
        stand now (an expired or released one shows 0)."""
        standing = {unit: until for unit, until in holds.items() if until > now}
        for unit in self._units - {UNKNOWN}:
            self._held_until.labels(unit).set(standing.get(unit, 0.0))
        for unit in standing.keys() - self._units:
            self._held_until.labels(self._unit(unit)).set(standing[unit])

    def released(self, unit: str) -> None:
        """A unit released: its halted gauge 0, for a unit that has a label; a name only a
        request named (the gate's socket takes any) gets none, so requests cannot grow
        /metrics."""
        if unit in self._units:
            self._halted.labels(unit).set(0)

    def halted_units(self, quarantined: set[str]) -> None:
        """Set `unit_halted` of every known unit from the quarantine records that exist now
        (a `release` by another process shows at the next scrape)."""
        for unit in self._units - {UNKNOWN}:
            self._halted.labels(unit).set(1 if unit in quarantined else 0)
        for unit in quarantined - self._units:
            self.units_halted(unit, True)

    def halted_crashes(self, records: Mapping[str, Mapping[str, Any]]) -> None:
        """Set `unit_halted_crash` from the quarantine records that exist now."""
        self._halted_crash.clear()
        for unit, record in records.items():
            proof, crash = proof_of(record), record.get("fingerprint")
            if proof is not None and isinstance(crash, str) and _FINGERPRINT.fullmatch(crash):
                self._halted_crash.labels(self._unit(unit), crash, proof).set(1)

    def running_starts(self, starts: Mapping[str, tuple[int | None, int | None]]) -> None:
        """Set `unit_start_timestamp_seconds` and `unit_serving` of every known unit from the
        tracker's (started, served) of its running invocation, in microseconds. A unit no
        longer configured (a reload removed it) shows none: the tracker keeps its last start
        but reads none of its entries, so it would never end and never serve."""
        for unit in self._units - {UNKNOWN}:
            started, served = starts.get(unit, (None, None))
            if unit not in self._supervised:
                started, served = None, None
            self._start.labels(unit).set(started / 1e6 if started else 0)
            self._serving.labels(unit).set(1 if served is not None else 0)
            self.start_served(unit, started, served)

    def start_phases(self, phases: Mapping[str, str]) -> None:
        """Set `unit_start_phase` from the tracker's phases of the running starts (known,
        supervised units only; a phase no engine file names is not a label)."""
        self._phase.clear()
        for unit, phase in phases.items():
            if unit in self._supervised and unit in self._units and phase in PHASES:
                self._phase.labels(unit, phase).set(1)

    def start_served(self, unit: str | None, started: int | None, served: int | None) -> None:
        """Observe a start's time to its first serving line, once per start (read while it
        runs, at a scrape, or at its end), for a known unit whose start was read."""
        if unit not in self._units or not started or not served or served < started:
            return
        if self._timed_starts.get(unit) == started:
            return
        self._timed_starts[unit] = started
        self._to_serving.labels(unit).observe((served - started) / 1e6)

    def gpu_xid(self, pci: str, xid: str) -> None:
        """Count one Xid of a GPU: at most MAX_GPUS addresses get a series of their own (the
        driver prints them; a host has a few), the others share 'other'."""
        if pci not in self._gpus and len(self._gpus) >= MAX_GPUS:
            pci = OTHER
        self._gpus.add(pci)
        self._gpu_xid.labels(pci, xid).inc()

    def fleet_lookup(self, result: str) -> None:
        """Count one fleet lookup by its result (FLEET_RESULTS; anything else is 'other')."""
        self._fleet.labels(result if result in FLEET_RESULTS else OTHER).inc()

    def lines_suppressed(self, unit: str | None, count: int) -> None:
        """Count lines journald dropped from a unit (its rate limit)."""
        self._suppressed.labels(self._unit(unit)).inc(max(0, count))

    def sink(self, name: str) -> None:
        """Create a sink's series at 0, so its first failure is an increase from 0."""
        sink = _sink_label(name)
        for outcome in NOTIFICATION_OUTCOMES:
            self._notifications.labels(sink, outcome)
        for reason in DROP_REASONS:
            self._dropped.labels(sink, reason)
        self._outbox.labels(sink)

    def notification(self, outcome: str, sink: str = "slack") -> None:
        """Count a notification event of a sink: queued, grouped, sent, retried, failed, ..."""
        label = outcome if outcome in NOTIFICATION_OUTCOMES else OTHER
        self._notifications.labels(_sink_label(sink), label).inc()

    def notification_dropped(self, sink: str, reason: str) -> None:
        """Count a message a sink gave up for good (see DROP_REASONS)."""
        label = reason if reason in DROP_REASONS else OTHER
        self._dropped.labels(_sink_label(sink), label).inc()

    def outbox_depth(self, n: int, sink: str = "slack") -> None:
        """Record how many of a sink's notifications wait for delivery."""
        self._outbox.labels(_sink_label(sink)).set(n)

    def state_error(self, reason: str) -> None:
        """Count a failure of the state database."""
        self._state_errors.labels(self._reason(reason, STATE_ERROR_REASONS)).inc()

    def exposition(self) -> tuple[bytes, str]:
        """The registry in Prometheus text format, with its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4


def new_registry(*, process: bool = True) -> CollectorRegistry:
    """A fresh registry, with the standard `process_*` series unless `process=False`.

    Exists so callers never import prometheus_client themselves (ruff TID251).
    """
    registry = CollectorRegistry(auto_describe=True)
    if process:
        ProcessCollector(registry=registry)
    return registry


def _seconds(us: int | None) -> float | None:
    return None if us is None else us / 1_000_000


def _sink_label(name: str) -> str:
    """A sink's name as a label value: bounded, whatever a caller passes."""
    return name if _SINK_NAME.fullmatch(name) else OTHER
