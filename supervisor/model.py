"""The data that flows through the pipeline: source -> tracker -> classifier -> policy.

Every value is an immutable, slotted dataclass so a stage can never change what an earlier
stage produced, and so the same objects serve the live daemon, `triage` and the tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from .util.when import iso_seconds, utc

EMPTY: Mapping[str, str] = MappingProxyType({})


_FIELD_INT_LIMIT = 1 << 64


def field_int(value: str | bytes | None) -> int | None:
    """A journal field's number (EXIT_STATUS, _PID, ...); None when absent or not a number.

    journald's numbers fit 64 bits: a longer one (a field a process sent, a journal file made
    by hand) is not a number, or its microseconds would overflow every float made of them."""
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        return None
    return number if -_FIELD_INT_LIMIT < number < _FIELD_INT_LIMIT else None


def _empty() -> Mapping[str, str]:
    return EMPTY


class Severity(StrEnum):
    """How a crash behaves under a restart."""

    FATAL = "fatal"  # the same crash recurs until a person acts
    TRANSIENT = "transient"  # a restart may work
    UNKNOWN = "unknown"  # no signature matched


class Basis(StrEnum):
    """What a verdict's severity rests on (its JSON value is the member's)."""

    SIGNATURE = "signature"  # the table
    INFERRED = "inferred"  # the exception and the phase (supervisor.classify.determinism)
    REPEATED = "repeated"  # the policy: the same crash again
    UNKNOWN = "unknown"


class Confidence(StrEnum):
    """How sure the root-cause line is."""

    HIGH = "high"
    MEDIUM = "medium"
    LOW = "low"


class Action(StrEnum):
    """What the policy decided to do about an ended invocation."""

    HALT = "halt"
    # Restart, but not before a delay that grows with each crash in a row (pacing): the gate
    # refuses starts until then and systemd starts the unit at the end (supervisor.actions.holds).
    HOLD = "hold"
    ALLOW_RESTART = "allow-restart"
    OBSERVE = "observe"


class Taken(StrEnum):
    """What the supervisor did about an ended invocation (history, Slack, metrics)."""

    HALTED = "halted"  # quarantined, and systemd was told (stopped, or the gate refused it)
    QUARANTINED = "quarantined"  # quarantined; systemd was not told (disabled or failing)
    HALT_FAILED = "halt-failed"  # the quarantine could not be written
    WOULD_HALT = "dry-run"  # a dry run: it would have halted (or held)
    # Its next start is held until a time: the gate refuses it, systemd starts it then.
    HELD = "held"
    RESTARTING = "restarting"  # systemd restarts it (its own Restart=)
    RESTARTED = "restarted"  # the supervisor restarted it (a hung engine; exit 0 after a crash)
    RESTART_FAILED = "restart-failed"
    DOWN = "down"  # it crashed and nothing restarts it
    RECORDED = "recorded"  # read late (history): reported, never acted on
    OBSERVED = "observed"


class LifecycleEvent(StrEnum):
    """systemd's messages about a unit, recognised by MESSAGE_ID (never by text)."""

    PROCESS_EXITED = "98e322203f7a4ed290d09fe03c09fe15"
    UNIT_FAILED = "d9b373ed55a64feb8242e02dbe79a49c"
    RESTART_SCHEDULED = "5eb03494b6584870a536b337290809b3"
    JOB_STARTED = "39f53479d3a045ac8e11786248231fbf"
    JOB_STOPPED = "9d1aaa27d60140bd96365438aad20286"
    DEACTIVATED = "7ad2d189f7e94e70a38c781354912448"
    CONDITION_SKIPPED = "0e4284a0caca4bfc81c0bb6786972673"
    OOM_KILLED = "fe6faa94e7774663a0da52717891d8ef"
    SUPPRESSED = "a596d6fe7bfa4994828e72309e95d61e"
    # A job began: "Starting U..." (JOB_TYPE=start, the new invocation's id) and "Stopping U..."
    # (JOB_TYPE=stop, also for `systemctl restart`): a stop job is a person's or a tool's.
    STARTING = "7d4958e842da4a758f6c1cdc7b36dcc5"
    STOPPING = "de5b426a63be47a7b6ac3eaac82e2f6f"


class Ending(StrEnum):
    """How an invocation came to its end, as the journal shows it."""

    EXITED = "exited"  # PID 1 logged "Failed with result" or "Deactivated successfully"
    STOPPED = "stopped"  # a stop or restart job ended it ("Stopping U..." while it ran), or
    #                      `systemctl kill` ("Sent signal SIGKILL ... on client request")
    SKIPPED = "skipped"  # its start was skipped by ExecCondition= (the gate)
    GATE_STOPPED = "gate-stopped"  # stopped while its ExecCondition= ran: it never started
    START_LIMIT = "start-limit"  # systemd refused to start it again (start-limit-hit)
    BOOT = "boot"  # the host rebooted (or lost power) before it ended
    UNSEEN = "unseen"  # a newer start came; this one's end was never logged
    HUNG = "hung"  # closed by the supervisor: its engine died while the unit stayed up
    OPEN = "open"  # still running at the end of a saved journal


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalEntry:
    """One decoded journal entry, reduced to the fields the pipeline reads.

    `unit` is the supervised unit the entry is *about*: `_SYSTEMD_UNIT` for the service's own
    lines, `UNIT` for PID 1's lifecycle messages. `invocation_id` likewise comes from
    `_SYSTEMD_INVOCATION_ID` or `INVOCATION_ID`.
    """

    cursor: str
    realtime_us: int
    message: str
    unit: str | None = None
    invocation_id: str | None = None
    pid: int | None = None
    priority: int | None = None
    message_id: str | None = None
    from_pid1: bool = False
    # Lifecycle fields (EXIT_CODE, EXIT_STATUS, UNIT_RESULT, N_RESTARTS, JOB_RESULT, ...).
    fields: Mapping[str, str] = field(default_factory=_empty)
    host: str | None = None  # _MACHINE_ID: which machine logged it (a directory may hold several)
    hostname: str | None = None  # _HOSTNAME, for people
    boot_id: str | None = None  # _BOOT_ID


@dataclass(frozen=True, slots=True, kw_only=True)
class LogLine:
    """A line the service printed, kept in an invocation for the classifier."""

    text: str
    pid: int | None = None
    priority: int | None = None
    realtime_us: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Invocation:
    """One start of a unit (one systemd invocation id) and how it ended."""

    unit: str | None
    invocation_id: str | None
    lines: tuple[LogLine, ...]
    total_lines: int = 0  # lines seen, including those not kept
    dropped_lines: int = 0  # lines not kept because of the memory caps
    suppressed_lines: int = 0  # lines journald's rate limit dropped ("Suppressed N messages")
    lines_in_limit_interval: int = 0  # its lines in journald's last rate-limit interval
    limit_burst: int = 0  # the unit's LogRateLimitBurst= as configured (0: not known)
    ending: Ending = Ending.EXITED
    host: str | None = None  # _MACHINE_ID of the machine it ran on
    hostname: str | None = None
    boot_id: str | None = None
    stop_requested: bool = False  # a stop or restart job began while it ran (a person, a tool)
    main_started: bool = False  # its main process ran (PID 1's "Started", or its exit was logged)
    # PID 1's "Starting"/"Started" of it was read. False: the journal was read from its middle
    # (the daemon attached to a running server): how long it ran and whether it served are not
    # known, so nothing is inferred from "before the server ever served".
    start_seen: bool = True
    served_us: int | None = None  # when it first logged that it serves (None: it never did)
    restart_of: str | None = None  # the invocation systemd restarted automatically into this one
    restart_scheduled: int | None = None  # N of "Scheduled restart job, restart counter is at N"
    end_message: str | None = None  # PID 1's "Main process exited, ..." or its OOM-kill message
    exit_code: str | None = None  # exited | killed | dumped
    exit_status: int | None = None
    result: str | None = None  # success | exit-code | signal | core-dump | oom-kill | ...
    restarts: int | None = None  # systemd's restart counter after this invocation
    oom_killed: bool = False
    hung: bool = False  # the engine died while the unit stayed active
    started_us: int | None = None
    ended_us: int | None = None
    ran_monotonic_s: float | None = None  # first entry to end, monotonic (one boot)
    first_cursor: str | None = None
    last_cursor: str | None = None

    @property
    def served(self) -> bool:
        """True when it logged that it serves before it ended."""
        return self.served_us is not None

    @property
    def ran_s(self) -> float | None:
        """Seconds from its first entry to its end, when both are known: on the monotonic
        clock when the journal says it (a wall clock stepped by an hour mid-start would make a
        crash at load look like one after serving), else on the wall clock."""
        if self.ran_monotonic_s is not None:
            return self.ran_monotonic_s
        if self.started_us is None or self.ended_us is None:
            return None
        return max(0.0, (self.ended_us - self.started_us) / 1e6)

    def lines_lost(self) -> str | None:
        """What journald's rate limit cost (or may have cost) its lines, in words.

        journald says "Suppressed N messages" only when the unit logs again after the
        interval, often after the decision; a run that logged the burst within one interval
        had its later lines dropped unless free disk scaled the burst up (up to ~6 times).
        """
        if self.suppressed_lines:
            return f"journald's rate limit dropped {self.suppressed_lines} lines"
        if self.total_lines == 0:
            return "no line of it reached the journal (journald's rate limit may have dropped all)"
        if self.limit_burst and self.lines_in_limit_interval >= self.limit_burst:
            return (
                f"it logged {self.lines_in_limit_interval} lines within one rate-limit interval, "
                f"past the unit's burst ({self.limit_burst}, more with free disk): its last "
                "lines, the crash's among them, may have been dropped by journald"
            )
        return None

    @property
    def failed(self) -> bool:
        """True when systemd itself saw a failure (non-zero exit, signal, OOM, failed result)."""
        if not ENDINGS[self.ending].can_fail:
            return False
        if self.oom_killed or self.hung:
            return True
        if self.result is not None and self.result != "success":
            return True
        if self.exit_code is not None and self.exit_code != "exited":
            return True
        return self.exit_status not in (None, 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """What the classifier concluded about an invocation's lines."""

    signature: str | None
    severity: Severity
    title: str
    root_cause: str | None
    crash_site: str | None = None
    captures: Mapping[str, str] = field(default_factory=_empty)
    remediation: str | None = None
    fingerprint: str | None = None
    # True when the lines show a crash (a traceback, an error-level cause, a matched signature),
    # which is how an invocation that exited 0 after its engine died is still seen as a crash.
    crashed: bool = False
    notes: tuple[str, ...] = ()
    # The root cause was logged while serving, long before the end (context, not proof).
    from_context: bool = False
    basis: Basis | None = None  # what the severity rests on
    confidence: Confidence | None = None  # how sure the root-cause line is
    severity_reason: str | None = None  # one line a person can check
    phase_hint: str | None = None  # "startup" or "serving", from the traceback's frames
    # An unknown crash: the side its evidence leans to, too weak to settle it (determinism.
    # assess). The policy halts one that leans fatal on its second identical start.
    leaning: Severity | None = None
    # The distributions its signature names (a halt lifts when one of these changes).
    packages: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The `verdict` object of the triage/history JSON contract (docs/DESIGN.md §4)."""
        return {
            "signature": self.signature,
            "severity": self.severity.value,
            "title": self.title,
            "root_cause": self.root_cause,
            "crash_site": self.crash_site,
            "captures": dict(self.captures),
            "remediation": self.remediation,
            "fingerprint": self.fingerprint,
            "notes": list(self.notes),
            "basis": None if self.basis is None else self.basis.value,
            "confidence": None if self.confidence is None else self.confidence.value,
            "severity_reason": self.severity_reason,
            "leaning": None if self.leaning is None else self.leaning.value,
        }


class Rule(StrEnum):
    """The rule that decided: a short code, bounded, the metric label (`Decision.reason` says
    the rest in words)."""

    # Not a crash (supervisor.decide.policy).
    SKIPPED = "skipped"
    GATE_STOPPED = "gate_stopped"
    BOOT = "boot"
    OPERATOR_STOP = "operator_stop"
    STILL_RUNNING = "still_running"
    START_LIMIT = "start_limit"
    CLEAN_EXIT = "clean_exit"
    # A crash (supervisor.decide.policy, supervisor.decide.port_evidence).
    FATAL_SIGNATURE = "fatal_signature"
    INFERRED_FATAL = "inferred_fatal"
    PORT_HELD = "port_held"
    # The kernel's Xid for the crash's GPU (supervisor.decide.xid_evidence): halted when a
    # restart cannot help (a reset, a reboot), restarted when NVIDIA says restart the app.
    GPU_XID = "gpu_xid"
    # Another host halted the same crash with the same environment (supervisor.decide.fleet).
    FLEET_PROOF = "fleet_proof"
    FATAL_AFTER_SERVING = "fatal_after_serving"
    TRANSIENT = "transient"
    UNKNOWN_FIRST = "unknown_first"
    UNKNOWN_REPEAT = "unknown_repeat"
    UNKNOWN_NO_CAUSE = "unknown_no_cause"
    UNKNOWN_AFTER_SERVING = "unknown_after_serving"
    # A paced unit serves again: its hold ended (supervisor.loop.serving_again), told once.
    SERVING_AGAIN = "serving_again"
    # Not the present invocation: recorded, not acted on (supervisor.actions.actor).
    LATE = "late"
    OTHER_HOST = "other_host"
    PREVIOUS_BOOT = "previous_boot"
    OTHER = "other"


# The rules that halt: the values of vllm_supervisor_halts_total's `reason` label.
HALT_RULES = (
    Rule.FATAL_SIGNATURE,
    Rule.UNKNOWN_REPEAT,
    Rule.INFERRED_FATAL,
    Rule.PORT_HELD,
    Rule.GPU_XID,
    Rule.FLEET_PROOF,
    Rule.OTHER,
)


class News(StrEnum):
    """Whether an ending is worth a message (supervisor.notify.decision)."""

    ALWAYS = "always"
    NEVER = "never"
    IF_CRASHED = "if-crashed"  # when systemd saw a failure or the lines show a crash


@dataclass(frozen=True, slots=True, kw_only=True)
class Meaning:
    """What an ending says, whatever the lines say: the one table every stage reads."""

    ran: bool = True  # the server ran: its lines are read for a crash (supervisor.classify)
    can_fail: bool = True  # systemd's failure counts as one (`Invocation.failed`)
    # Not a crash: the policy observes it, by this rule and reason (supervisor.decide.policy).
    not_a_crash: tuple[Rule, str] | None = None
    resets_streak: bool = False  # a person, or a reboot, stepped in: repeats start afresh
    news: News = News.IF_CRASHED


ENDINGS: Mapping[Ending, Meaning] = MappingProxyType(
    {
        Ending.EXITED: Meaning(),
        Ending.HUNG: Meaning(),
        Ending.UNSEEN: Meaning(),
        Ending.SKIPPED: Meaning(
            ran=False,
            can_fail=False,
            not_a_crash=(Rule.SKIPPED, "start skipped by its ExecCondition gate"),
            news=News.NEVER,
        ),
        Ending.GATE_STOPPED: Meaning(
            ran=False,
            can_fail=False,
            not_a_crash=(Rule.GATE_STOPPED, "stopped while its ExecCondition gate ran"),
            news=News.NEVER,
        ),
        Ending.START_LIMIT: Meaning(
            ran=False,
            not_a_crash=(
                Rule.START_LIMIT,
                "systemd gave up restarting the unit (start-limit-hit)",
            ),
            news=News.ALWAYS,
        ),
        Ending.BOOT: Meaning(
            can_fail=False,
            not_a_crash=(
                Rule.BOOT,
                "ended with the boot: the host went down before the unit ended",
            ),
            resets_streak=True,
            news=News.NEVER,
        ),
        Ending.STOPPED: Meaning(
            not_a_crash=(
                Rule.OPERATOR_STOP,
                "ended by a stop, restart or kill request (a person or a tool), not a crash",
            ),
            resets_streak=True,
            news=News.NEVER,
        ),
        Ending.OPEN: Meaning(
            not_a_crash=(Rule.STILL_RUNNING, "still running at the end of the journal"),
            news=News.NEVER,
        ),
    }
)


def served_by(*, serving_seen: bool, ran_s: float | None, good_start_s: float) -> bool:
    """The one rule of "it served": it logged that it serves (a serving line, requests
    handled), or it ran at least `good_start_s`. A good start for drift, the phase of a crash."""
    return serving_seen or (ran_s is not None and ran_s >= good_start_s)


@dataclass(frozen=True, slots=True, kw_only=True)
class Phase:
    """How far the invocation got before it ended."""

    served: bool
    ran_s: float | None = None  # from its first entry to its end
    serving_s: float | None = None  # from its first serving line to its end, when known
    start_seen: bool = True  # False: read from the journal's middle, its start unknown

    def describe(self) -> str:
        """In words: before the server ever served, or after serving for how long."""
        if not self.served:
            return "before the server ever served"
        if self.serving_s is not None:
            return f"after serving for {duration(self.serving_s)}"
        return "after serving"


def phase_of(invocation: Invocation, good_start_s: float, hint: str | None = None) -> Phase:
    """Served (`served_by`), or, with nothing in the journal either way, the crash's frames
    are request handling (`hint`, the classifier's reading of them)."""
    ran = invocation.ran_s
    serving_s = None
    if invocation.served_us is not None and invocation.ended_us is not None:
        serving_s = max(0.0, (invocation.ended_us - invocation.served_us) / 1e6)
    served = served_by(serving_seen=invocation.served, ran_s=ran, good_start_s=good_start_s)
    if not served and hint == "serving":
        served = True
    return Phase(served=served, ran_s=ran, serving_s=serving_s, start_seen=invocation.start_seen)


def duration(seconds: float) -> str:
    """A span of time as a person reads it: "45 s", "4 min", "1 h 0 min"."""
    minutes = int(seconds // 60)
    if minutes < 1:
        return f"{seconds:.0f} s"
    if minutes < 60:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60} min"


@dataclass(frozen=True, slots=True)
class CauseFacts:
    """What the root cause's line and traceback say beside its text, for determinism.assess."""

    # The text whose wording counts: the cause a wrapper carries; None: the verdict's own.
    words: str | None = None
    # The class it names: its exception line, a carried cause's, or a raise statement's.
    exception: str | None = None
    frame: str | None = None  # the innermost frame of its traceback: where it was raised
    callers: tuple[str, ...] = ()  # the frames around it, outermost first
    raise_statement: bool = False  # the cause is that frame's `raise X(...)`: the line was cut
    pointer: bool = False  # the line only points at a cause printed elsewhere (a wrapper)
    guessed: bool = False  # no line was a candidate: a guess; only the frame and ending count
    # Its main process was SIGKILLed right after the engine said it kills its own process tree
    # (an engine file's `self_kill`): that kill is the engine's own end, not one from outside.
    killed_itself: bool = False


NO_FACTS = CauseFacts()


@dataclass(frozen=True, slots=True, kw_only=True)
class Ended:
    """An ended invocation as its lines read, not yet decided: the classifier's reading (a
    verdict before the phase and the evidence are weighed) and the facts of its cause."""

    invocation: Invocation
    reading: Verdict
    facts: CauseFacts = NO_FACTS
    examined_s: float = 0.0  # how long reading the lines took (the classification metric)


@dataclass(frozen=True, slots=True, kw_only=True)
class PortHeld:
    """Who holds the port a port-in-use crash could not bind, now (supervisor.decide.
    port_evidence): named, and whether it outlives the unit's restarts."""

    port: int
    holders: str | None  # named for a person; None: no other process holds it now
    before_start: bool = False  # a holder's process started before the crashed invocation
    outlives: bool = False  # before the start, or the same socket held it at the last crash


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuXid:
    """The kernel's Xid joined to a crash (supervisor.decide.xid_evidence): same host and boot,
    logged shortly before the engine's first error."""

    code: int
    pci: str  # the GPU's PCI address, as the driver printed it
    line: str  # the driver's line, from `NVRM:`
    realtime_us: int
    boot_id: str | None
    meaning: str | None  # the catalog's (config/xid.toml); None: an Xid it does not list
    action: str | None  # the catalog's action key (supervisor.classify.xid.ACTIONS)
    what_to_do: str | None
    restart_helps: bool  # a restart of the engine alone can get past it


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetProof:
    """Another host's halt of the same crash in the same environment, read from the fleet's
    shared Alertmanager (supervisor.decide.fleet): whose, and since when."""

    host: str
    unit: str
    crash: str  # the crash's fingerprint (supervisor.classify.fingerprint)
    environment: str  # the environment's fleet digest (supervisor.environment.fingerprint)
    since_s: float  # unix time of that halt
    crashes: int | None = None  # the crashes that host saw before it halted, when it said

    def cited(self) -> str:
        """How a record and a message cite it."""
        at = utc(self.since_s)
        when = "an unknown time" if at is None else at.strftime("%Y-%m-%d %H:%M UTC")
        after = f" after {self.crashes} crashes" if self.crashes else ""
        return f"the same crash with the same packages halted {self.host} at {when}{after}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Evidence:
    """What is known of an ended invocation beside its lines, gathered before it is decided
    (the hooks fill it: supervisor.seams.BatchHook.evidence); `decide` reads nothing else."""

    phase: Phase
    # What changed in the unit's environment since its last good start
    # (supervisor.environment.drift).
    drift: tuple[str, ...] = ()
    port: PortHeld | None = None
    # The listen address a start-up crash could not bind, not on this host now
    # (supervisor.decide.address_evidence).
    address: str | None = None
    xid: GpuXid | None = None  # the GPU's fault the kernel logged before the crash
    fleet: FleetProof | None = None  # another host's halt of this crash, environment alike


@dataclass(frozen=True, slots=True, kw_only=True)
class Pace:
    """A held start (`Action.HOLD`): how long the next start waits, and after how many crashes
    in a row of starts that each ended within the pacing's reset (supervisor.decide.pacing)."""

    delay_s: float
    crashes: int
    # Whether no hold of the unit stood before this one (the actor knows: the record was not
    # there, or serving again or `release` removed it); None before it was carried out.
    begins: bool | None = None

    @property
    def first(self) -> bool:
        """True for the hold that begins pacing (again): the one that is told."""
        return self.begins if self.begins is not None else self.crashes <= PACE_FIRST_CRASH

    def to_json(self) -> dict[str, Any]:
        return {"delay_s": self.delay_s, "crashes": self.crashes}


# The crash in a row (of starts that ended within the reset) whose next start is the first held.
PACE_FIRST_CRASH = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """What to do about an ended invocation, and why."""

    action: Action
    reason: str  # in words, for a person: what the rule saw
    dry_run: bool = False
    rule: Rule = Rule.OTHER
    pace: Pace | None = None  # with Action.HOLD
    # The crashes in a row a halt rests on (the fleet cites it: "halted gpu-12 after 2").
    crashes: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The `decision` object of the triage/history JSON contract."""
        said: dict[str, Any] = {
            "action": self.action.value,
            "reason": self.reason,
            "dry_run": self.dry_run,
            "rule": self.rule.value,
        }
        if self.pace is not None:
            said["hold"] = self.pace.to_json()
        if self.crashes is not None:
            said["crashes"] = self.crashes
        return said


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """One ended invocation with its verdict and decision: what triage prints and history keeps."""

    invocation: Invocation
    verdict: Verdict
    decision: Decision
    # What changed in the unit's environment since its last good start
    # (supervisor.environment.drift).
    drift: tuple[str, ...] = ()
    taken: Taken = Taken.OBSERVED  # what the supervisor did (set by supervisor.actions)
    taken_detail: str = ""  # one sentence on it: what was done, or why nothing was
    # The invocation whose halt still stood when this one crashed: the same story, told once.
    already_halted_by: str | None = None

    def to_json(self) -> dict[str, Any]:
        """One element of the `invocations` list of the triage/history JSON contract."""
        inv = self.invocation
        return {
            "unit": inv.unit,
            "invocation_id": inv.invocation_id,
            "exit_code": inv.exit_code,
            "exit_status": inv.exit_status,
            "result": inv.result,
            "restarts": inv.restarts,
            "lines": inv.total_lines,
            "dropped_lines": inv.dropped_lines,
            "suppressed_lines": inv.suppressed_lines,
            "ending": inv.ending.value,
            "host": inv.hostname or inv.host,
            "started": _iso(inv.started_us),
            "ended": _iso(inv.ended_us),
            "served": inv.served,
            "hung": inv.hung,
            "verdict": self.verdict.to_json(),
            "decision": self.decision.to_json(),
            "taken": self.taken.value,
            "taken_detail": self.taken_detail,
            "drift": list(self.drift),
            "already_halted_by": self.already_halted_by,
        }


def _iso(us: int | None) -> str | None:
    """A journal timestamp (microseconds since the epoch) in ISO 8601, UTC."""
    return iso_seconds(us, per_second=1_000_000) if us is not None and us > 0 else None


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitState:
    """A snapshot of one unit's state as systemd reports it."""

    active_state: str  # active | activating | deactivating | inactive | failed | reloading
    sub_state: str  # for a service: running | auto-restart | exited | dead | failed | ...
    n_restarts: int  # systemd's automatic restart counter (NRestarts)
    result: str  # the last run's result: success | exit-code | signal | ...
    invocation_id: str  # hex, "" when the unit never ran
    main_pid: int  # 0 when no main process runs
    load_state: str = "loaded"
    gated: bool = False  # its ExecCondition= is our gate: a start is refused while quarantined

    @property
    def restarting_or_running(self) -> bool:
        """True when a stop is needed to keep the unit down (it runs or a restart is pending)."""
        return self.active_state in ("active", "activating", "reloading") or (
            self.sub_state == "auto-restart"
        )
