"""Configuration: declared once as frozen dataclasses, loaded from TOML, validated completely.

Every field carries its default next to it and a short comment that the README reuses. Unknown
keys, wrong types and cross-field conflicts raise `ConfigError` naming the key and the fix, so a
bad config stops the daemon with one line before it touches anything.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .engines.profiles import current
from .errors import ConfigError
from .util.text import visible
from .util.urls import url_problem

DEFAULT_RUNTIME_DIR = Path("/run/vllm-supervisor")
DEFAULT_STATE_DIR = Path("/var/lib/vllm-supervisor")
WEBHOOK_ENV = "VLLM_SUPERVISOR_SLACK_WEBHOOK_URL"
WEBHOOK_CREDENTIAL = "slack-webhook"
# Every float setting is a duration in seconds. One past a year is a typo, and a larger one
# (or an infinity, a NaN) overflows where it becomes microseconds or a socket timeout.
MAX_SECONDS = 365 * 24 * 3600

# The reader child cuts each field at 4 bytes a character (its --data-threshold, a C long); a
# line of 16 Mi characters is far past journald's LineMax= and still fits.
MAX_LINE_CHARS = 1 << 24

# systemd's longest unit name (UNIT_NAME_MAX is 256 with the NUL); the reader child, which
# takes the names on its stdin, refuses one over 4 KiB and would be restarted forever.
UNIT_NAME_MAX = 255
# systemd unit names: "name.type" with an optional "@instance" (systemd.unit(5)).
_UNIT_NAME = re.compile(
    r"^[A-Za-z0-9:_.\\-]+(@[A-Za-z0-9:_.\\-]*)?\."
    r"(service|socket|target|device|mount|automount|swap|path|timer|slice|scope)$"
)

# A host's name as an alert label carries it (RFC 1123 labels, and '_' some fleets use).
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


class Secret(str):
    """A string that never shows itself in a repr, a log line or an error message."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "Secret('********')"

    def __str__(self) -> str:
        return "********"

    @property
    def value(self) -> str:
        """The secret itself, for the one place that must send it."""
        return str.__str__(self)


SUPERVISOR_UNIT = "vllm-supervisor.service"  # the daemon's own unit, as deploy/ installs it


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitConfig:
    """One supervised unit and its own settings."""

    name: str  # the systemd unit, e.g. "vllm.service"
    unknown_repeat_limit: int = 3  # halt when the same unknown crash ends this many invocations
    dry_run: bool = False  # decide and report, never stop this unit
    signature_sets: tuple[str, ...] = ()  # signature domains to use (file stems); empty = all
    health_url: str | None = None  # loopback URL that answers 2xx while the engine serves
    hang_grace_s: float = 30.0  # an engine death with the unit still active for this long = hang
    # Halt on the first crash when its severity is inferred fatal (an ImportError, a usage
    # error, ... before the server ever served), not only when a signature says fatal.
    halt_inferred: bool = True
    # An unknown crash after serving counts toward unknown_repeat_limit only when it came
    # within this long of serving (a crash on the first request every time).
    repeat_window_s: float = 120.0
    port: int | None = None  # the port the server binds: preflight, and who holds it at a crash
    python: str | None = None  # the served unit's interpreter; default: read from ExecStart
    # Pacing (supervisor.decide.pacing): from the 2nd crash in a row of starts that each ended
    # within pace_reset_s, the next start is held pace_first_s, doubling with each further crash
    # up to pace_max_s; a start that runs pace_reset_s ends the run of crashes. Kubernetes'
    # CrashLoopBackOff is 10 s doubling to 5 min; a model that loads for 10 minutes wants longer.
    pace_first_s: float = 60.0
    pace_max_s: float = 3600.0
    pace_reset_s: float = 600.0


@dataclass(frozen=True, slots=True, kw_only=True)
class JournalConfig:
    """Where and how the journal is read."""

    directory: Path | None = None  # a journal directory (journalctl -D); None = system journal
    # Entries of this machine (its _MACHINE_ID) are acted on; other hosts' are only reported.
    # Empty: this host's /etc/machine-id.
    machine_id: str = ""
    journalctl: str = "journalctl"  # the journalctl binary
    # The reader child: "native" (libsystemd, built with the package), "journalctl", or "auto"
    # (native when it was built, else journalctl).
    reader: str = "auto"
    start_at: str = "auto"  # with no saved cursor: "head", "tail" or "auto" (tail; head for -D)
    restart_backoff_s: float = 1.0  # first wait before restarting a dead reader (doubles)
    restart_backoff_max_s: float = 30.0  # the longest wait between reader restarts
    # Follow the kernel's NVIDIA driver lines (its Xid faults) beside the units' (a small
    # `journalctl _TRANSPORT=kernel` child): a GPU fault becomes the cause of the crash it caused.
    kernel: bool = True


@dataclass(frozen=True, slots=True, kw_only=True)
class TrackerConfig:
    """Memory caps of one invocation's kept lines."""

    head_lines: int = 200  # the first lines of an invocation, always kept
    tail_lines: int = 400  # the last lines before it ended, always kept
    max_error_lines: int = 2000  # error-level lines and tracebacks kept in between
    # ... and all of them together (head 1/8, tail 3/8, error lines 1/2 of it): long lines then
    # keep fewer, so an invocation's memory is bounded in bytes, not only in lines.
    # 512 KiB: an open run of 16 KiB lines holds ~0.49 MB; the corpus's decisions are the same
    # as with 1 MiB, and 8 ranks' longest real traceback fit whole after a flood.
    max_invocation_bytes: int = 1 << 19
    max_line_chars: int = 16384  # a longer line is cut to this many characters
    max_open_invocations: int = 16  # per unit and host; the oldest open one is closed past this
    settle_s: float = 0.3  # after a unit ends, how long its late stdout lines are still awaited
    settle_after_start_s: float = 0.1  # ... once the unit's next start began (never longer)
    # Past those, each late line of the ended run keeps the wait open (journald writing a
    # flood it received before the end), at most this long after the end.
    drain_max_s: float = 10.0
    ratelimit_interval_s: float = 30.0  # journald's RateLimitIntervalSec= (lost-line reports)
    # The unit's LogRateLimitBurst= (the gate drop-in's): a crash with no error line that
    # logged this many lines within the interval may have lost its own lines to journald.
    ratelimit_burst: int = 100_000
    # An error logged while serving more than this long before the end is context, not cause.
    cause_window_s: float = 120.0


@dataclass(frozen=True, slots=True, kw_only=True)
class StateConfig:
    """Where state lives."""

    state_dir: Path = DEFAULT_STATE_DIR  # SQLite database: cursor, history, outbox
    runtime_dir: Path = DEFAULT_RUNTIME_DIR  # quarantine records read by `gate`
    persistent_quarantine: bool = False  # keep halts across reboots (state_dir instead of runtime)
    on_bad_cursor: str = "tail"  # a saved cursor from another journal: "tail" or "head"
    commit_retry_max_s: float = 30.0  # longest wait between retries of a failed commit (disk full)
    checkpoint_interval_s: float = 1.0  # batches with no decision commit the cursor this often


@dataclass(frozen=True, slots=True, kw_only=True)
class SlackConfig:
    """Slack incoming webhook; off when no URL is configured anywhere."""

    webhook_url: Secret | None = None  # or env VLLM_SUPERVISOR_SLACK_WEBHOOK_URL / credential
    webhook_url_file: Path | None = None  # a file holding the URL (e.g. a systemd credential)
    notify_transient: bool = True  # also post transient crashes (grouped per interval)
    group_interval_s: float = 600.0  # transient crashes of one signature: one message per interval
    backlog_hold_s: float = 10.0  # crashes read late (a backlog) wait this long to be one message
    timeout_s: float = 10.0  # one HTTP attempt
    max_attempts: int = 8  # per message, before it is marked failed
    backoff_max_s: float = 300.0  # longest wait between attempts
    min_interval_s: float = 1.0  # at most one message per this many seconds per webhook


@dataclass(frozen=True, slots=True, kw_only=True)
class AlertmanagerConfig:
    """Prometheus Alertmanager as a sink, beside or instead of Slack; off without a URL.

    A halted unit is a firing alert (labels unit, host, signature, severity), re-sent while it
    stays halted as Prometheus re-sends its own; a release resolves it."""

    url: str | None = None  # e.g. "http://127.0.0.1:9093"; alerts go to {url}/api/v2/alerts
    # The other Alertmanagers of an HA cluster: alerts go to each (a cluster gossips silences
    # and notifications, not alerts), and the fleet reads the first that answers.
    peers: tuple[str, ...] = ()
    resend_s: float = 60.0  # a firing alert is sent again this often; it ends 4 x this after
    timeout_s: float = 10.0  # one HTTP attempt
    backoff_max_s: float = 60.0  # longest wait between attempts while Alertmanager is down

    def urls(self) -> tuple[str, ...]:
        """`url` and its peers; none without `url`."""
        return (self.url, *self.peers) if self.url else ()


@dataclass(frozen=True, slots=True, kw_only=True)
class FleetConfig:
    """What hosts share through the Alertmanager they push to (supervisor.decide.fleet): a
    halt of a crash, by its fingerprint and its environment's digest, that another host reads
    at its own first crash. On only with `alertmanager.url`. With it on, the halts the fleet
    shares are told by that Alertmanager's group, once per crash, not by the Slack webhook."""

    share: bool = False  # publish this host's halts and read the others'
    # This host's name in every alert it sends (the halt's and the fleet's); empty: the
    # machine's hostname, which the shipped Prometheus rule derives from `instance`: another
    # name must match it, or the rule's alert and the daemon's are not one.
    host: str = ""
    window_s: float = 21600.0  # a proof older than this (6 h) is no proof
    timeout_s: float = 0.5  # the longest a crash's decision waits for Alertmanager's answer


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsConfig:
    """The Prometheus endpoint (/metrics and /healthz)."""

    enabled: bool = True
    listen: str = "127.0.0.1:9464"  # host:port; loopback by default


@dataclass(frozen=True, slots=True, kw_only=True)
class SystemdConfig:
    """How the daemon talks to systemd."""

    enabled: bool = True  # False: never call systemd (triage, tests without a bus)
    stop_timeout_s: float = 10.0  # one D-Bus call
    stop_attempts: int = 5  # StopUnit retries within bounds
    # A crash read later than this after its end is history unless systemd confirms it is still
    # the unit's present (a restart pending); without systemd, it is always history then.
    act_window_s: float = 60.0


@dataclass(frozen=True, slots=True, kw_only=True)
class GateConfig:
    """The served units' `ExecCondition=` gate, which waits for the daemon's decision."""

    # How long a gate waits for the daemon to read and decide the unit's last run, then lets
    # the start go (with a line saying so). Keep it below the served unit's TimeoutStartSec=.
    wait_s: float = 30.0
    # With no daemon to ask, how long a gate waits for one that systemd is bringing back (its
    # restart, or its restart after a crash or the watchdog's kill: WatchdogSec=30s,
    # RestartSec=2s). A stopped supervisor is not waited for. wait_s plus this stays below the
    # default TimeoutStartSec= (90 s).
    supervisor_restart_wait_s: float = 45.0


# The libraries a served environment's drift is recorded for, beside the engines' packages.
LIBRARIES: tuple[str, ...] = (
    "torch",
    "flashinfer-python",
    "flashinfer-cubin",
    "flashinfer-jit-cache",
    "triton",
    "transformers",
    "tokenizers",
    "xformers",
    "nvidia-nccl-cu12",
    "nvidia-cuda-runtime-cu12",
    "nvidia-cudnn-cu12",
    "ray",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class DriftConfig:
    """Environment recorded at each start of a served unit."""

    # Default: every engine file's packages, then the libraries they crash in.
    packages: tuple[str, ...] = field(default_factory=lambda: (*current().packages, *LIBRARIES))
    good_start_s: float = 600.0  # an invocation that ran this long counts as a good start


LOCAL_SIGNATURES = "signatures.d"  # beside the config file: this host's own signatures


@dataclass(frozen=True, slots=True, kw_only=True)
class SignaturesConfig:
    """The signature table."""

    paths: tuple[Path, ...] = ()  # TOML files or directories; empty = the shipped table
    # Added to that table when they exist (`signatures propose --write` puts its proposals
    # there); None: the config file's own signatures.d directory (none without a file).
    local: tuple[Path, ...] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The whole daemon configuration."""

    units: tuple[UnitConfig, ...] = ()
    dry_run: bool = False  # decide and report for every unit, never stop one
    journal: JournalConfig = field(default_factory=JournalConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    state: StateConfig = field(default_factory=StateConfig)
    slack: SlackConfig = field(default_factory=SlackConfig)
    alertmanager: AlertmanagerConfig = field(default_factory=AlertmanagerConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    systemd: SystemdConfig = field(default_factory=SystemdConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    drift: DriftConfig = field(default_factory=DriftConfig)
    signatures: SignaturesConfig = field(default_factory=SignaturesConfig)

    def unit(self, name: str) -> UnitConfig:
        """The settings of one unit; defaults for a unit not in the config."""
        for unit in self.units:
            if unit.name == name:
                return unit
        return UnitConfig(name=name)

    def is_dry_run(self, unit: str) -> bool:
        """True when decisions about `unit` are only reported."""
        return self.dry_run or self.unit(unit).dry_run


def _quoted_line(text: str, exc: tomllib.TOMLDecodeError) -> str:
    """The key on the line a TOML error points at, so the one-line error names the typo.
    Only the key: the value may be a secret (a webhook URL)."""
    match = re.search(r"at line (\d+)", str(exc))
    lines = text.splitlines()
    if match is None or not 0 < int(match.group(1)) <= len(lines):
        return ""
    key, equals, _ = lines[int(match.group(1)) - 1].partition("=")
    return f", in the value of {key.strip()[:80]!r}" if equals and key.strip() else ""


def load_config(path: Path | None) -> Config:
    """Read and validate a config file; None gives the defaults."""
    if path is None:
        return validate(Config())
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}{_quoted_line(text, exc)}") from exc
    except RecursionError as exc:  # tomllib's answer to arrays or tables nested thousands deep
        raise ConfigError(f"{path}: not valid TOML: nested too deeply") from exc
    try:
        config = _build(Config, raw, "")
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    base = path.parent
    local = config.signatures.local
    config = dataclasses.replace(
        config,
        signatures=SignaturesConfig(
            paths=tuple(p if p.is_absolute() else base / p for p in config.signatures.paths),
            local=tuple(
                p if p.is_absolute() else base / p
                for p in (local if local is not None else (Path(LOCAL_SIGNATURES),))
            ),
        ),
    )
    try:
        return validate(config)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def validate(config: Config) -> Config:
    """Check the rules that span fields; return the config unchanged."""
    names = [u.name for u in config.units]
    for index, name in enumerate(names):
        if not _UNIT_NAME.match(name):
            raise ConfigError(
                f"unit[{index}].name: {name!r} is not a systemd unit name (e.g. 'vllm.service')"
            )
        if len(name) > UNIT_NAME_MAX:
            raise ConfigError(
                f"unit[{index}].name: {name[:40]!r}... is longer than systemd's {UNIT_NAME_MAX}"
                " characters"
            )
        if names.count(name) > 1:
            raise ConfigError(f"unit[{index}].name: {name!r} is listed twice")
        if "@." in name:
            stem, suffix = name.split("@.", 1)
            raise ConfigError(
                f"unit[{index}].name: {name!r} is a template, which never runs itself; list "
                f"each instance to supervise ('{stem}@0.{suffix}', '{stem}@1.{suffix}', ...; "
                f"`systemctl list-units '{stem}@*'` shows them)"
            )
    for index, unit in enumerate(config.units):
        _positive(f"unit[{index}].unknown_repeat_limit", unit.unknown_repeat_limit)
        _positive(f"unit[{index}].hang_grace_s", unit.hang_grace_s)
        _positive(f"unit[{index}].repeat_window_s", unit.repeat_window_s)
        for key in ("pace_first_s", "pace_max_s", "pace_reset_s"):
            _positive(f"unit[{index}].{key}", getattr(unit, key))
        if unit.pace_max_s < unit.pace_first_s:
            raise ConfigError(
                f"unit[{index}].pace_max_s: must be >= pace_first_s ({unit.pace_first_s:g}; "
                f"got {unit.pace_max_s:g})"
            )
        if unit.port is not None and not 0 < unit.port < 65536:
            raise ConfigError(f"unit[{index}].port: must be 1..65535 (got {unit.port})")
        if unit.health_url is not None:
            _loopback_url(f"unit[{index}].health_url", unit.health_url)
    if config.journal.start_at not in ("auto", "head", "tail"):
        raise ConfigError(
            f"journal.start_at: must be 'auto', 'head' or 'tail' (got {config.journal.start_at!r})"
        )
    if config.journal.reader not in ("auto", "native", "journalctl"):
        raise ConfigError(
            "journal.reader: must be 'auto', 'native' or 'journalctl'"
            f" (got {config.journal.reader!r})"
        )
    if config.state.on_bad_cursor not in ("head", "tail"):
        raise ConfigError(
            f"state.on_bad_cursor: must be 'head' or 'tail' (got {config.state.on_bad_cursor!r})"
        )
    for key in (
        "head_lines",
        "tail_lines",
        "max_error_lines",
        "max_invocation_bytes",
        "max_line_chars",
        "max_open_invocations",
        "ratelimit_interval_s",
        "ratelimit_burst",
        "cause_window_s",
    ):
        _positive(f"tracker.{key}", getattr(config.tracker, key))
    if config.tracker.max_line_chars > MAX_LINE_CHARS:
        raise ConfigError(
            f"tracker.max_line_chars: must be at most {MAX_LINE_CHARS}"
            f" (got {config.tracker.max_line_chars})"
        )
    for key in ("settle_s", "settle_after_start_s", "drain_max_s"):
        if getattr(config.tracker, key) < 0:
            raise ConfigError(f"tracker.{key}: must be >= 0 (got {getattr(config.tracker, key)})")
    _positive("journal.restart_backoff_s", config.journal.restart_backoff_s)
    _positive("state.commit_retry_max_s", config.state.commit_retry_max_s)
    _positive("state.checkpoint_interval_s", config.state.checkpoint_interval_s)
    _positive("systemd.act_window_s", config.systemd.act_window_s)
    _positive("gate.wait_s", config.gate.wait_s)
    _positive("gate.supervisor_restart_wait_s", config.gate.supervisor_restart_wait_s)
    for key in ("resend_s", "timeout_s", "backoff_max_s"):
        _positive(f"alertmanager.{key}", getattr(config.alertmanager, key))
    url = config.alertmanager.url
    if url is not None and (problem := url_problem(url)) is not None:
        raise ConfigError(
            f"alertmanager.url: not a usable http(s) URL: {problem} (value not shown)"
        )
    for index, peer in enumerate(config.alertmanager.peers):
        if (problem := url_problem(peer)) is not None:
            raise ConfigError(
                f"alertmanager.peers[{index}]: not a usable http(s) URL: {problem} "
                "(value not shown)"
            )
    if config.alertmanager.peers and url is None:
        raise ConfigError("alertmanager.peers: set alertmanager.url first (peers go beside it)")
    for key in ("window_s", "timeout_s"):
        _positive(f"fleet.{key}", getattr(config.fleet, key))
    if config.fleet.host and not _HOST_NAME.fullmatch(config.fleet.host):
        raise ConfigError(
            f"fleet.host: expected a host name of letters, digits, '.', '_' and '-' "
            f"(got {config.fleet.host!r})"
        )
    _positive("slack.timeout_s", config.slack.timeout_s)
    _positive("slack.max_attempts", config.slack.max_attempts)
    if config.slack.webhook_url is not None and config.slack.webhook_url_file is not None:
        raise ConfigError(
            "slack: at most one of webhook_url and webhook_url_file may be set (remove one)"
        )
    if config.slack.webhook_url is not None:
        check_webhook_url(config.slack.webhook_url, "slack.webhook_url")
    parse_listen(config.metrics.listen, key="metrics.listen")
    return config


def parse_listen(value: str, *, key: str = "--metrics-listen") -> tuple[str, int]:
    """Split HOST:PORT (IPv6 hosts in brackets) and check the port."""
    host, sep, port = value.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) < 65536:
        raise ConfigError(f"{key}: expected HOST:PORT such as 127.0.0.1:9464 (got {value!r})")
    return host.strip("[]") or "127.0.0.1", int(port)


def resolve_webhook(config: SlackConfig, environ: Mapping[str, str] = os.environ) -> Secret | None:
    """The webhook URL from the config, its file, the environment or a systemd credential."""
    if config.webhook_url is not None:
        return config.webhook_url
    path = config.webhook_url_file
    if path is None and environ.get(WEBHOOK_ENV):
        return Secret(environ[WEBHOOK_ENV].strip())
    if path is None and environ.get("CREDENTIALS_DIRECTORY"):
        candidate = Path(environ["CREDENTIALS_DIRECTORY"]) / WEBHOOK_CREDENTIAL
        path = candidate if candidate.exists() else None
    if path is None:
        return None
    try:
        return Secret(path.read_text(encoding="utf-8").strip())
    except OSError as exc:
        raise ConfigError(f"slack.webhook_url_file: cannot read {path}: {exc.strerror}") from exc
    except UnicodeDecodeError:  # `from None`: the error holds the file's bytes, the secret
        raise ConfigError(
            f"slack.webhook_url_file: {path} is not UTF-8 text (value not shown)"
        ) from None


def webhook_source(config: SlackConfig, environ: Mapping[str, str] = os.environ) -> str:
    """Where `resolve_webhook` takes the URL from, for messages that must not show it."""
    if config.webhook_url is not None:
        return "slack.webhook_url"
    if config.webhook_url_file is not None:
        return f"slack.webhook_url_file {config.webhook_url_file}"
    if environ.get(WEBHOOK_ENV):
        return f"env {WEBHOOK_ENV}"
    return f"credential {Path(environ.get('CREDENTIALS_DIRECTORY', '')) / WEBHOOK_CREDENTIAL}"


def check_webhook_url(url: Secret, source: str) -> None:
    """Raise ConfigError naming `source`, never the URL, when it cannot be posted to."""
    problem = url_problem(url.value)
    if problem is not None:
        raise ConfigError(f"{source}: not a usable webhook URL: {problem} (value not shown)")


def check_webhook(config: SlackConfig, environ: Mapping[str, str] = os.environ) -> None:
    """`check-config`: the webhook URL wherever it comes from, as the daemon will read it."""
    url = resolve_webhook(config, environ)
    if url is not None:
        check_webhook_url(url, webhook_source(config, environ))


def _loopback_url(key: str, url: str) -> None:
    """Health URLs are probed only on loopback: the daemon never reaches out across a network."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"{key}: expected an http(s) URL such as http://127.0.0.1:8000/health (got {url!r})"
        )
    host = parts.hostname
    if host not in ("localhost", "::1") and not host.startswith("127."):
        raise ConfigError(
            f"{key}: only loopback hosts are probed (127.0.0.0/8, ::1, localhost; got {url!r})"
        )


def _positive(key: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{key}: must be > 0 (got {value})")


def _build(cls: type[Any], raw: Any, prefix: str) -> Any:
    """Turn a TOML table into the dataclass `cls`, rejecting unknown keys and wrong types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a table")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    aliases = {"unit": "units"} if cls is Config else {}
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        name = aliases.get(key, key)
        if name not in known:
            choices = ", ".join(sorted(known))
            raise ConfigError(f"{prefix}{visible(key)}: unknown key (expected one of: {choices})")
        kwargs[name] = _convert(hints[name], value, f"{prefix}{key}")
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {exc}") from exc


def _convert(hint: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if type(None) in args and value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], value, key)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, f"{key}.")
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list (got {type(value).__name__})")
        return tuple(_convert(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if hint is Path:
        return Path(_text(value, key))
    if hint is Secret:
        if not isinstance(value, str):  # a URL in a list or a table would show in the line
            raise ConfigError(f"{key}: expected str (got {type(value).__name__}, not shown)")
        return Secret(_text(value, key))
    if hint is float:
        return _seconds(value, key)
    if hint is str:
        return _text(value, key)
    return _expect(hint, value, key)


def _seconds(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}: expected a number (got {value!r})")
    # Compared before float(): an integer of 400 digits does not convert.
    if not -MAX_SECONDS <= value <= MAX_SECONDS:  # False for NaN too
        raise ConfigError(
            f"{key}: expected a number of seconds between -{MAX_SECONDS} and {MAX_SECONDS}"
            f" (a year; got {value!r})"
        )
    return float(value)


def _text(value: Any, key: str) -> str:
    """A string a path, a URL or a name can be made of: a NUL byte fails every system call."""
    text: str = _expect(str, value, key)
    if "\x00" in text:
        raise ConfigError(f"{key}: contains a NUL byte (\\u0000), which no path or name may hold")
    return text


def _expect(kind: type[Any], value: Any, key: str) -> Any:
    # bool is an int in Python; a TOML `true` must not pass as a count.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {kind.__name__} (got {value!r})")
    return value


def with_units(config: Config, names: Sequence[str]) -> Config:
    """Add units given on the command line (`--unit`), with default settings."""
    known = {u.name for u in config.units}
    extra = tuple(UnitConfig(name=n) for n in names if n not in known)
    return validate(dataclasses.replace(config, units=config.units + extra))


# Read once at start-up (the reader child, the state database, the listening sockets, the Slack
# client, the tracker's caps): a change needs a restart of the daemon.
RESTART_ONLY = (
    "journal",
    "tracker",
    "state",
    "slack",
    "alertmanager",
    "fleet",
    "metrics",
    "systemd",
    "gate",
    "drift",
)


def restart_only_changes(old: Config, new: Config) -> list[str]:
    """The keys that differ between `old` and `new` but only take effect after a restart."""
    changed: list[str] = []
    for section in RESTART_ONLY:
        before, after = getattr(old, section), getattr(new, section)
        for key in dataclasses.fields(before):
            if getattr(before, key.name) != getattr(after, key.name):
                changed.append(f"{section}.{key.name}")
    return changed
