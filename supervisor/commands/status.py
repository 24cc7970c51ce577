"""`vllm-supervisor status [UNIT]`: the first screen of an incident.

What is halted on this host, since when and why, how to release it, which unit's next start
is held (paced: when it comes, after how many crashes, why), what systemd says of each
supervised unit, its last verdicts and what changed in its environment, and whether the
supervisor itself runs and is healthy. One command instead of `gate`, `history`, `systemctl`
and `curl /healthz`.

Every source is read independently and may be missing (systemd unreachable, the daemon down,
the state database not there yet): what could not be read is said, the rest is shown. The exit
status is for scripts: 0 nothing halted and the daemon healthy, 1 a unit is halted, 3 the daemon
is not running or not healthy (and nothing is halted). A paced unit is no halt: its start comes
by itself, so it leaves the exit status as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from .. import __version__
from ..actions import Hold, SystemdClient, ask_once, holds_of, quarantine_records, real_name
from ..config import SUPERVISOR_UNIT, Config, parse_listen
from ..environment import PROC, Holder, holders
from ..errors import SupervisorError, SystemdError
from ..model import UnitState, duration
from ..store import Store
from ..util.daemon_lock import LOCK_NAME, lock_holder
from ..util.jsontext import loads
from ..util.text import for_terminal, visible
from ..util.when import iso_seconds, utc
from .options import resolve_config

EXIT_HEALTHY = 0
EXIT_HALTED = 1
EXIT_DAEMON_DOWN = 3  # as `systemctl status` says of an inactive unit
LAST_VERDICTS = 3
HEALTH_TIMEOUT_S = 2.0
SYSTEMD_TIMEOUT_S = 2.0
# A held start further away than this shows its date too, not only its time of day.
CLOCK_ONLY_WITHIN_S = 12 * 3600.0

NO_SUCH_UNIT = "no such unit"  # systemd's LoadState=not-found
UnitStateLookup = Callable[[Sequence[str]], dict[str, UnitState | str]]
Health = Callable[[str], tuple[bool, dict[str, Any]] | str]
Scrape = Callable[[str], str | None]  # the daemon's /metrics text, or None without an answer
READER_RESTARTS = "vllm_supervisor_journal_source_restarts_total"
RUNNING_START = "vllm_supervisor_unit_start_timestamp_seconds"
RUNNING_SERVING = "vllm_supervisor_unit_serving"
BUILD_INFO = "vllm_supervisor_build_info"
_UNIT_LABEL = re.compile(r'unit="((?:[^"\\]|\\.)*)"')
_VERSION_LABEL = re.compile(r'version="([0-9A-Za-z.+!_-]{1,64})"')


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitStatus:
    """One supervised unit as the sources say it."""

    unit: str
    systemd: dict[str, Any] | None  # ActiveState, SubState, NRestarts, InvocationID
    systemd_error: str | None = None
    exists: bool | None = None  # False: systemd knows no such unit; None: it was not asked
    halted: dict[str, Any] | None = None  # the quarantine record, with its path
    halted_error: str | None = None  # why the quarantine records could not be read
    last: tuple[dict[str, Any], ...] = ()  # newest first
    drift: tuple[str, ...] = ()  # of the newest crash
    running: dict[str, Any] | None = None  # the daemon's view: when it started, whether it serves
    hold: dict[str, Any] | None = None  # its standing hold (pacing): the next start and why
    hold_error: str | None = None  # why the hold records could not be read

    def to_json(self) -> dict[str, Any]:
        """The unit's entry of `status --format json`."""
        return dataclasses.asdict(self) | {"last": list(self.last), "drift": list(self.drift)}


@dataclass(frozen=True, slots=True, kw_only=True)
class DaemonStatus:
    """The supervisor itself."""

    running: bool | None  # None: its lock could not be read
    pid: int | None = None
    healthy: bool | None = None  # None: /healthz not asked (metrics off) or not answering
    health: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    squatter: str | None = None  # who else holds the metrics port: /healthz not trusted
    reader_restarts: int | None = None  # of its journal reader child, from /metrics
    version: str | None = None  # the running daemon's, from /metrics (maybe not the installed)
    # Per unit, from /metrics: the running invocation's start (Unix time) and whether it serves.
    starts: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Status:
    """Everything `status` shows."""

    units: tuple[UnitStatus, ...]
    daemon: DaemonStatus

    @property
    def exit_code(self) -> int:
        """0 healthy, 1 a unit halted, 3 the daemon down or unhealthy, or can't tell (no such
        unit, the quarantine records unreadable, another process on the metrics port)."""
        if any(u.halted for u in self.units):
            return EXIT_HALTED
        if any(u.exists is False or u.halted_error for u in self.units):
            return EXIT_DAEMON_DOWN
        daemon = self.daemon
        if not (daemon.running and daemon.healthy is not False) or daemon.squatter:
            return EXIT_DAEMON_DOWN
        return EXIT_HEALTHY

    def to_json(self) -> dict[str, Any]:
        """`status --format json`."""
        return {
            "units": [u.to_json() for u in self.units],
            "daemon": dataclasses.asdict(self.daemon),
            "exit_code": self.exit_code,
        }


def gather(
    config: Config,
    units: Sequence[str],
    *,
    unit_states: UnitStateLookup | None = None,
    health: Health | None = None,
    clock: Callable[[], float] = time.time,
) -> Status:
    """Read every source for `units` (the configured ones by default)."""
    names = list(units) or [u.name for u in config.units]
    states = (unit_states or systemd_states)(names) if names else {}
    halted, halted_error = _quarantine_records(config)
    holds, hold_error = _hold_records(config)
    now = clock()
    history = _history(config.state.state_dir)
    daemon = daemon_status(config, health or ask_health)
    return Status(
        units=tuple(
            _unit_status(
                name,
                states.get(name, "not asked"),
                halted.get(name),
                history,
                halted_error=halted_error,
                running=daemon.starts.get(name),
                hold=standing_hold(holds.get(name), now),
                hold_error=hold_error,
            )
            for name in names
        ),
        daemon=daemon,
    )


def _quarantine_records(config: Config) -> tuple[dict[str, dict[str, Any]], str | None]:
    """The records, or why they could not be read (then no unit can be called not halted)."""
    try:
        return quarantine_records(config), None
    except OSError as exc:
        where = exc.filename or config.state.runtime_dir
        return {}, f"cannot read the quarantine records: {where}: {exc.strerror or exc}"


def _hold_records(config: Config) -> tuple[dict[str, Hold], str | None]:
    """The readable hold records, or why they could not be read (a record that is no hold
    holds nothing, as for the gate)."""
    try:
        return holds_of(config), None
    except OSError as exc:
        where = exc.filename or config.state.runtime_dir
        return {}, f"cannot read the hold records: {where}: {exc.strerror or exc}"


def standing_hold(hold: Hold | None, now: float) -> dict[str, Any] | None:
    """The `hold` object of `status --format json`: a hold whose start is still ahead; None
    for none, or one whose time has passed (the gate lets that start through)."""
    if hold is None or hold.until <= now:
        return None
    return {
        "until": iso_seconds(hold.until),
        "until_epoch": hold.until,
        "left_s": hold.left_s(now),
        "since": iso_seconds(hold.since),
        "crashes": hold.crashes,
        "rule": hold.rule or None,
        "reason": hold.reason or None,
        "invocation_id": hold.invocation_id,
        "signature": hold.signature,
    }


def _unit_status(
    unit: str,
    state: UnitState | str,
    halted: dict[str, Any] | None,
    history: list[dict[str, Any]],
    *,
    halted_error: str | None = None,
    running: dict[str, Any] | None = None,
    hold: dict[str, Any] | None = None,
    hold_error: str | None = None,
) -> UnitStatus:
    mine = [h for h in history if isinstance(h, dict) and h.get("unit") == unit]
    mine = mine[-LAST_VERDICTS:][::-1]
    last = tuple(_verdict_line(h) for h in mine)
    crashes = [h for h in mine if isinstance(h.get("drift"), list) and h["drift"]]
    systemd = None if isinstance(state, str) else _state_json(state)
    return UnitStatus(
        unit=unit,
        systemd=systemd,
        systemd_error=state if isinstance(state, str) else None,
        exists=False if state == NO_SUCH_UNIT else (True if systemd is not None else None),
        halted=halted,
        halted_error=None if halted else halted_error,
        last=last,
        drift=tuple(str(d) for d in crashes[0]["drift"]) if crashes else (),
        running=running,
        hold=hold,
        hold_error=None if hold else hold_error,
    )


def _mapping(value: object) -> dict[str, Any]:
    """A JSON object read from disk or the network, or an empty one for anything else."""
    return value if isinstance(value, dict) else {}


def _state_json(state: UnitState) -> dict[str, Any]:
    return {
        "active_state": state.active_state,
        "sub_state": state.sub_state,
        "n_restarts": state.n_restarts,
        "invocation_id": state.invocation_id or None,
    }


def _verdict_line(item: dict[str, Any]) -> dict[str, Any]:
    verdict, decision = _mapping(item.get("verdict")), _mapping(item.get("decision"))
    return {
        "time": item.get("time"),
        "invocation_id": item.get("invocation_id"),
        "severity": verdict.get("severity"),
        "signature": verdict.get("signature"),
        "root_cause": verdict.get("root_cause"),
        "action": decision.get("action"),
        "rule": decision.get("rule"),
        "taken": item.get("taken"),
    }


def _history(state_dir: Path) -> list[dict[str, Any]]:
    store = Store.existing_in_directory(state_dir)  # read-only; None when it cannot be read
    if store is None:
        return []
    try:
        return store.history()
    except SupervisorError:
        return []
    finally:
        store.close()


def systemd_states(units: Sequence[str]) -> dict[str, UnitState | str]:
    """Each unit's state from systemd over D-Bus, or why it could not be read."""

    async def states(client: SystemdClient) -> dict[str, UnitState | str]:
        answers: dict[str, UnitState | str] = {}
        for unit in units:
            try:
                answers[unit] = await client.unit_state(unit)
            except SystemdError as exc:
                answers[unit] = NO_SUCH_UNIT if exc.reason == "no_such_unit" else str(exc)
        return answers

    try:
        return ask_once(states, timeout_s=SYSTEMD_TIMEOUT_S)
    except (SupervisorError, OSError) as exc:
        return dict.fromkeys(units, f"systemd not reachable: {exc}")


def daemon_status(config: Config, health: Health, scrape: Scrape | None = None) -> DaemonStatus:
    """Whether a daemon holds this state directory's lock, what its /healthz says, and from
    its /metrics how often its journal reader was restarted and each unit's running start."""
    running, pid, error = lock_holder(config.state.state_dir / LOCK_NAME)
    if not running:
        return DaemonStatus(running=running, pid=pid, error=error)
    if not config.metrics.enabled:
        return DaemonStatus(running=True, pid=pid, error="metrics.enabled = false: no /healthz")
    host, port = parse_listen(config.metrics.listen, key="metrics.listen")
    squatter = metrics_squatter(port, pid)
    if squatter is not None:
        return DaemonStatus(running=True, pid=pid, squatter=squatter)
    answer = health(f"http://{_url_host(host)}:{port}/healthz")
    if isinstance(answer, str):
        return DaemonStatus(running=True, pid=pid, error=answer)
    healthy, details = answer
    exposition = (scrape or ask_metrics)(f"http://{_url_host(host)}:{port}/metrics")
    return DaemonStatus(
        running=True,
        pid=pid,
        healthy=healthy,
        health=details,
        reader_restarts=None if exposition is None else reader_restarts_in(exposition),
        version=version_in(exposition or ""),
        starts=unit_starts_in(exposition or ""),
    )


def metrics_squatter(port: int, pid: int | None, proc: Path = PROC) -> str | None:
    """Who, besides the daemon of the lock file (`pid`), listens on the metrics port; None when
    no one does. A local user may bind the port while the daemon restarts: its /healthz
    answer would then be the stranger's, and must not be reported as the daemon's health."""
    strangers = [h for h in holders(port, proc) if not _is_daemon(h, pid, proc)]
    if not strangers:
        return None
    who = "; ".join(_holder_words(h) for h in strangers)
    return f"metrics port {port} held by {who}, not the supervisor (pid {pid or '?'})"


def _is_daemon(holder: Holder, pid: int | None, proc: Path) -> bool:
    if pid is None:
        return False
    if holder.pid is not None:
        return holder.pid == pid
    # Another user's open files are not visible: its uid is all the socket table tells.
    try:
        return holder.uid == (proc / str(pid)).stat().st_uid
    except OSError:
        return False


def _holder_words(holder: Holder) -> str:
    if holder.pid is None:
        return f"a process of uid {holder.uid}"
    return f"PID {holder.pid}" + (f" ({holder.command})" if holder.command else "")


def _url_host(host: str) -> str:
    if host in ("", "0.0.0.0"):  # noqa: S104 - a listen address, asked on loopback
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def ask_health(url: str) -> tuple[bool, dict[str, Any]] | str:
    """The daemon's /healthz: (healthy, its JSON), or why it did not answer."""
    try:
        with httpx.Client(timeout=HEALTH_TIMEOUT_S, trust_env=False) as client:
            response = client.get(url)
        body = loads(response.content)
    except (httpx.HTTPError, ValueError) as exc:
        return f"{url}: {type(exc).__name__}: {exc}"
    if not isinstance(body, dict):
        return f"{url}: not a JSON object"
    return response.status_code == 200, body


def ask_metrics(url: str) -> str | None:
    """The daemon's /metrics text, or None without an answer."""
    try:
        with httpx.Client(timeout=HEALTH_TIMEOUT_S, trust_env=False) as client:
            return client.get(url).text
    except httpx.HTTPError:
        return None


def reader_restarts_in(exposition: str) -> int:
    """The sum of the reader restart counter's series (every reason) in Prometheus text."""
    total = sum(v for name, _, v in _samples(exposition) if name == READER_RESTARTS and v > 0)
    return int(min(total, 2**62))


def version_in(exposition: str) -> str | None:
    """The running daemon's version, from its build_info series in Prometheus text."""
    for name, labels, value in _samples(exposition):
        if name == BUILD_INFO and value == 1 and (found := _VERSION_LABEL.search(labels)):
            return found.group(1)
    return None


def unit_starts_in(exposition: str) -> dict[str, dict[str, Any]]:
    """Each unit's running start in Prometheus text: {"started": Unix time, "serving": bool},
    for the units whose start the daemon read (a start of 0 is none running, or not seen)."""
    starts: dict[str, float] = {}
    serving: dict[str, bool] = {}
    for name, labels, value in _samples(exposition):
        match = _UNIT_LABEL.fullmatch(labels)
        if match is None or name not in (RUNNING_START, RUNNING_SERVING):
            continue
        if value <= 0 or utc(value) is None:  # 0: none running; past 9999: no time
            continue
        unit = re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), match[1])
        if name == RUNNING_START:
            starts[unit] = value
        else:
            serving[unit] = True
    return {
        unit: {"started": started, "serving": serving.get(unit, False)}
        for unit, started in starts.items()
    }


def _samples(exposition: str) -> Iterator[tuple[str, str, float]]:
    """(name, the text between its braces, value) of each line of Prometheus text whose value
    is a finite number; whatever else answers on the port is passed over."""
    for line in exposition.splitlines():
        head, _, tail = line.rpartition(" ")
        try:
            value = float(tail)
        except ValueError:
            continue
        if math.isfinite(value):
            name, brace, labels = head.partition("{")
            yield name.split(" ", 1)[0], labels.rpartition("}")[0] if brace else "", value


def render_text(status: Status) -> str:
    """A person's screen."""
    out: list[str] = []
    for unit in status.units:
        out += _render_unit(unit)
    out += _render_daemon(status.daemon)
    # Each line is built from values of files, systemd and /healthz: shown, never obeyed, and
    # a newline inside one cannot forge a line of the screen.
    return "\n".join(visible(line) for line in out) + "\n"


def _mark(unit: UnitStatus) -> str:
    if unit.halted:
        return "HALTED"
    if unit.exists is False:
        return NO_SUCH_UNIT
    if unit.halted_error:
        return "halt state unknown"
    if unit.hold:
        return "paced"
    if unit.systemd is None:
        return "not halted, systemd state unknown"
    return "ok"


def _render_unit(unit: UnitStatus) -> list[str]:
    lines = [f"● {unit.unit}: {_mark(unit)}"]
    if unit.systemd is not None:
        s = unit.systemd
        lines.append(
            f"    systemd:   {s['active_state']} ({s['sub_state']}), "
            f"{s['n_restarts']} automatic restarts, invocation {s['invocation_id'] or '-'}"
        )
    elif unit.exists is not False:
        lines.append(f"    systemd:   unknown ({unit.systemd_error})")
    if unit.halted_error:
        lines.append(f"    halted:    unknown ({unit.halted_error})")
    if unit.halted:
        h = unit.halted
        lines += [
            f"    halted:    since {h.get('time')} by invocation {h.get('invocation_id') or '-'}",
            f"    signature: {h.get('signature') or 'unknown'} ({h.get('severity')})",
            f"    cause:     {h.get('root_cause') or '-'}",
        ]
        if h.get("remediation"):
            lines.append(f"    fix:       {h['remediation']}")
        lines.append(f"    release:   vllm-supervisor release {unit.unit}   (record: {h['path']})")
    if unit.hold:
        lines += _hold_lines(unit.unit, unit.hold)
    elif unit.hold_error:
        lines.append(f"    paced:     unknown ({unit.hold_error})")
    for item in unit.last:
        lines.append(
            f"    last:      {item['time']}  {item['severity']!s:9} "
            f"{item['signature'] or '-'}  → {item['action']} ({item['rule']}, {item['taken']})"
        )
    if unit.running:
        lines.append(f"    running:   {_running_words(unit.running)}")
    if unit.drift:
        lines.append(f"    changed:   {'; '.join(unit.drift)}")
    return lines


def _hold_lines(unit: str, hold: dict[str, Any]) -> list[str]:
    """A standing hold: when the next start comes, after how many crashes, why, and how to
    start it now."""
    crashes = hold["crashes"]
    rule = f" ({hold['rule']})" if hold["rule"] else ""
    lines = [
        f"    paced:     next start {_next_start_words(hold['until_epoch'], hold['left_s'])}, "
        f"after {crashes} crash{'' if crashes == 1 else 'es'} in a row{rule}"
    ]
    if hold["reason"]:
        lines.append(f"    why:       {hold['reason']}")
    lines.append(
        f"    start now: vllm-supervisor release {unit}   (else systemd starts it then: "
        "systemctl list-timers 'vllm-supervisor-hold-*')"
    )
    return lines


def _next_start_words(until: float, left_s: float) -> str:
    """When the held start comes, as "10:42 UTC (in 3 min)"; with its date when it is further
    away than half a day."""
    at = utc(until)
    if at is None:
        return f"at an unknown time (in {duration(left_s)})"
    form = "%H:%M UTC" if left_s < CLOCK_ONLY_WITHIN_S else "%Y-%m-%d %H:%M UTC"
    return f"{at.strftime(form)} (in {duration(left_s)})"


def _running_words(running: dict[str, Any], now: float | None = None) -> str:
    """The running line: its start in UTC, how long ago, and whether it serves yet."""
    started = float(running["started"])
    age = max(0, int((time.time() if now is None else now) - started))
    at = utc(started)
    when = "at an unknown time" if at is None else at.isoformat(timespec="seconds")
    hours, minutes = divmod(age // 60, 60)
    ago = f"{hours} h {minutes} min" if hours else f"{minutes} min"
    state = "serving" if running.get("serving") else "not serving yet"
    return f"started {when} ({ago} ago), {state}"


def _render_daemon(daemon: DaemonStatus) -> list[str]:
    if not daemon.running:
        state = "unknown" if daemon.running is None else "NOT RUNNING"
        return [f"● vllm-supervisor: {state} ({daemon.error})"]
    health = {True: "healthy", False: "UNHEALTHY", None: "health unknown"}[daemon.healthy]
    running = f"pid {daemon.pid or '?'}" + (f", version {daemon.version}" if daemon.version else "")
    lines = [f"● vllm-supervisor: running ({running}), {health}"]
    if daemon.version and daemon.version != __version__:
        lines.append(
            f"    note:      {__version__} is installed: restart it to run that "
            "(systemctl restart vllm-supervisor)"
        )
    if daemon.squatter:
        lines.append(f"    problem:   {daemon.squatter}; its /healthz is not asked")
    details = daemon.health
    if details:
        lines.append(
            f"    journal:   following={details.get('following')}, "
            f"lag {details.get('journal_lag_s', '?')} s; outbox {details.get('outbox_depth', 0)} "
            f"waiting; {details.get('pending_commits', 0)} uncommitted"
        )
    lines += _sink_lines(details)
    reasons = details.get("reasons")
    for reason in reasons if isinstance(reasons, list) else []:
        lines.append(f"    problem:   {reason}")
    if daemon.reader_restarts and details.get("following") is False:
        lines.append(
            f"    problem:   the journal reader keeps failing: restarted {daemon.reader_restarts}"
            f" times ({READER_RESTARTS}); nothing is read or decided; its error: journalctl -u"
            f" {SUPERVISOR_UNIT} -g journal_reader_failing"
        )
    if daemon.error:
        lines.append(f"    note:      {daemon.error}")
    return lines


def _sink_lines(details: dict[str, Any]) -> list[str]:
    """One line per sink as /healthz has it, and what a reload left for a restart."""
    lines = []
    for name, sink in _mapping(details.get("sinks")).items():
        sink = _mapping(sink)
        state, error = sink.get("state"), sink.get("last_error")
        if state == "on":
            words = "on" if error is None else f"on; last error: {error}"
        elif state == "invalid_url":
            words = f"INVALID URL ({error}), so off"
        else:
            words = f"{state}" if error is None else f"{state} ({error})"
        lines.append(f"    {name + ':':<10} {words}")
    pending = details.get("not_reloaded")
    if isinstance(pending, list) and pending:
        lines.append(f"    restart:   to apply {'; '.join(map(str, pending))}")
    return lines


def status_main(
    config: Config,
    units: Sequence[str],
    *,
    output_format: str = "text",
    out: TextIO,
    unit_states: UnitStateLookup | None = None,
    health: Health | None = None,
    clock: Callable[[], float] = time.time,
) -> int:
    """Print the status; the exit code says halted (1), daemon down (3) or healthy (0)."""
    status = gather(config, units, unit_states=unit_states, health=health, clock=clock)
    if output_format == "json":
        out.write(json.dumps(status.to_json(), indent=2) + "\n")
    else:
        out.write(for_terminal(render_text(status)))
    return status.exit_code


def main(args: argparse.Namespace) -> int:
    """`status [UNIT...]`: halted units, why and since when, and the daemon's health."""
    config = resolve_config(args)
    units = [real_name(unit) for unit in args.unit]
    return status_main(config, units, output_format=args.format, out=sys.stdout)
