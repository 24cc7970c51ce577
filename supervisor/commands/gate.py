"""`vllm-supervisor gate UNIT`, `release UNIT` and `recheck UNIT`: the ExecCondition check,
its undo, and the check of a halt that can clear by itself.

`gate` runs as the served unit's `ExecCondition=` (docs/DESIGN.md §3): exit 1 skips the start (and,
since systemd PR #22259, a skipped start is not restarted even with `Restart=always`), exit 0
lets it run. It runs from *another* unit, so it must not trust that unit's RUNTIME_DIRECTORY:
it reads the installed config (or `--config`), checks the configured directories and the
defaults, runtime and persistent. It fails closed on a quarantine record only (one that cannot
be read or parsed included); a config it cannot load, a directory it cannot search, a daemon
that does not answer or a fault of its own let the start go, with one line that says so.

A held start (supervisor.actions.holds: a paced loop's next start waits until a deadline) is
refused too, once systemd holds the timer that starts the unit at that deadline; a hold whose
timer systemd will not take lets the start go, with one line (it would otherwise end only when
a person acts).

Before it reads the records it waits for the running daemon to have decided the unit's last run
(supervisor.actions.gatekeeper), bounded by `gate.wait_s`: at any `RestartSec=`, even 0, the
start after a fatal crash is refused, not let through. With no daemon running it asks systemd
whether the supervisor's own unit is coming back (a restart, a crash or the watchdog's kill
being restarted) and waits for it, bounded by `gate.supervisor_restart_wait_s`
(supervisor.actions.comeback); else it says so in one line and lets the start go: a missing
supervisor must not take the server down.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, TextIO

from ..actions import (
    DEFAULT_DIRS,
    Holds,
    Quarantine,
    Reply,
    SupervisorUnit,
    active_hold,
    arm_once,
    arm_recheck_once,
    ask,
    ask_about,
    cause_gone,
    changed,
    coming_back,
    disarm_once,
    hold_dirs,
    note_release,
    quarantine_dirs,
    real_name,
    socket_path,
    start_once,
    still_holds,
    waits_on_a_condition,
)
from ..config import DEFAULT_RUNTIME_DIR, SUPERVISOR_UNIT, Config, load_config
from ..errors import SupervisorError, SystemdError
from ..model import duration
from ..util.text import visible
from ..util.when import clock_time
from .options import config_path

EXIT_ALLOW = 0
EXIT_QUARANTINED = 1  # 1..254 from ExecCondition= skips the start (systemd.service(5))


RELEASE_NOTIFY_TIMEOUT_S = 2.0
RECHECK_FIRST_S = 10.0  # a halt that can clear by itself is checked this soon, at first
RECHECK_MAX_S = 60.0  # ... and at least this often while it lasts
COMEBACK_POLL_S = 0.1  # how often a gate knocks while the supervisor comes back
COMEBACK_LOOK_S = 1.0  # how often it asks systemd whether it still does
NAME_TIMEOUT_S = 1.0  # for systemd's answer to "which unit is this name?"; unanswered: as named


def main(args: argparse.Namespace) -> int:
    """`gate UNIT`: the ExecCondition check. It runs in the served unit, whose environment
    (RUNTIME_DIRECTORY) is not the daemon's: the directories come from the config, and the
    drop-in's `--runtime-dir`/`--state-dir` add places a record may be in, so one is found even
    when the config does not load. That must not skip every start (exit 2 is "condition
    failed" to systemd): the gate then says so in one line and goes on."""
    try:
        config = load_config(config_path(args))
    except Exception as exc:  # a ConfigError, or a fault of the loader's own: never a refusal
        why = str(exc) if isinstance(exc, SupervisorError) else f"{exc!r}; please report it"
        _say(f"{args.unit}: the supervisor's config does not load ({why})", file=sys.stderr)
        config = Config()
    state = config.state
    runtime_dir = state.runtime_dir
    if runtime_dir == DEFAULT_RUNTIME_DIR and args.runtime_dir is not None:
        runtime_dir = args.runtime_dir  # where the daemon's socket is, for a test's daemon
    named = tuple(d for d in (args.runtime_dir, args.state_dir) if d is not None)
    # Records are filed under the unit's real name; a gate written with an alias must find them.
    unit = real_name(args.unit, timeout_s=NAME_TIMEOUT_S)
    if unit != args.unit:
        _say(f"{args.unit} is {unit}: its records are read under that name", file=sys.stderr)
    return gate_main(
        unit,
        runtime_dir,
        state.state_dir,
        wait_s=config.gate.wait_s,
        defaults=(*named, *DEFAULT_DIRS),
        supervisor_wait_s=config.gate.supervisor_restart_wait_s,
        supervisor_unit=args.supervisor_unit,
    )


def gate_main(
    unit: str,
    runtime_dir: Path,
    state_dir: Path,
    *,
    wait_s: float,
    out: TextIO | None = None,
    defaults: Sequence[Path] = DEFAULT_DIRS,
    invocation_id: str | None = None,
    supervisor_wait_s: float = 0.0,
    supervisor_unit: str = SUPERVISOR_UNIT,
) -> int:
    """Exit status for ExecCondition: 1 while a record of `unit` exists (readable or not),
    else 0, whatever else goes wrong.

    `invocation_id` is the start's own (systemd sets $INVOCATION_ID for ExecCondition=).
    `supervisor_wait_s` bounds the wait for a supervisor that systemd is bringing back.
    """
    stream = out if out is not None else sys.stderr
    refused = _refused_by_records(unit, runtime_dir, state_dir, defaults, stream)
    if refused is not None:
        return refused
    waiting = _Waiting(wait_s, supervisor_wait_s, lambda: ask_about(supervisor_unit))
    try:
        return _wait_then_check(
            unit, runtime_dir, state_dir, waiting, stream, defaults, invocation_id
        )
    except Exception as exc:  # the gate's own fault: never the reason a server stays down
        _say(f"{unit}: start allowed: the gate failed ({exc!r}); please report it", file=stream)
        return _refused_by_records(unit, runtime_dir, state_dir, defaults, stream) or EXIT_ALLOW


class _Waiting:
    """How long a gate waits, and how it learns whether the supervisor is coming back."""

    def __init__(
        self,
        decision_s: float,
        comeback_s: float,
        about: Callable[[], SupervisorUnit | None],
    ) -> None:
        self.decision_s = decision_s
        self.comeback_s = comeback_s
        self.about = about


def _wait_then_check(
    unit: str,
    runtime_dir: Path,
    state_dir: Path,
    waiting: _Waiting,
    stream: TextIO,
    defaults: Sequence[Path],
    invocation_id: str | None,
) -> int:
    """Wait for the daemon's decision about the unit's last run, then read the records."""
    if invocation_id is None:
        invocation_id = os.environ.get("INVOCATION_ID") or None
    request = {"op": "gate", "unit": unit, "invocation_id": invocation_id}
    path = socket_path(runtime_dir)
    reply = ask(path, request, timeout_s=waiting.decision_s + 1.0)
    if not reply.reached and waiting.comeback_s > 0:
        reply = _wait_for_comeback(unit, path, request, reply, waiting, stream)
    _say_how_it_waited(unit, reply, waiting.decision_s, stream)
    if not reply.reached:
        return EXIT_ALLOW
    return _check_records(unit, runtime_dir, state_dir, defaults, stream) or EXIT_ALLOW


def _wait_for_comeback(
    unit: str,
    path: Path,
    request: dict[str, Any],
    reply: Reply,
    waiting: _Waiting,
    stream: TextIO,
) -> Reply:
    """While systemd brings the supervisor back, knock until it answers (bounded): a crash
    that ended while it was away is then decided before this start, not after a few more."""
    deadline = time.monotonic() + waiting.comeback_s
    said = False
    next_look = 0.0
    while time.monotonic() < deadline:
        if time.monotonic() >= next_look:
            supervisor = waiting.about()
            why = (
                coming_back(supervisor, within_s=waiting.comeback_s)
                if supervisor is not None
                else None
            )
            if why is None:
                return reply
            if not said:
                _say(f"{unit}: waiting for the supervisor: {why}", file=stream)
                said = True
            next_look = time.monotonic() + COMEBACK_LOOK_S
        time.sleep(COMEBACK_POLL_S)
        left = deadline - time.monotonic()
        reply = ask(path, request, timeout_s=max(0.1, min(waiting.decision_s + 1.0, left)))
        if reply.reached:
            return reply
    return dataclasses.replace(
        reply,
        note=f"{reply.note}, and the supervisor was not back within {waiting.comeback_s:.0f} s",
    )


def _say_how_it_waited(unit: str, reply: Reply, wait_s: float, stream: TextIO) -> None:
    """One line when the start goes ahead without the daemon's word."""
    if not reply.reached:
        _say(f"{unit}: start allowed: {reply.note}; nothing decides about its crashes", file=stream)
    elif reply.answer.get("supervised") is False:
        _say(
            f"{unit}: start allowed: the running supervisor's config does not name it; add it "
            "there, or remove its drop-in (vllm-supervisor setup does both)",
            file=stream,
        )
    elif not reply.answer.get("decided", False):
        _say(
            f"{unit}: start allowed: the supervisor has not decided about the last run within "
            f"{wait_s:.0f} s ({reply.answer.get('waited', 'no reason given')})",
            file=stream,
        )


def _refused_by_records(
    unit: str, runtime_dir: Path, state_dir: Path, defaults: Sequence[Path], stream: TextIO
) -> int | None:
    """`_check_records`, for a gate that must answer 0 or 1: when reading the records fails
    in a way of its own (its exit would be 2, a refusal with no record behind it), it refuses
    only on a record file it sees."""
    try:
        return _check_records(unit, runtime_dir, state_dir, defaults, stream)
    except Exception as exc:
        _say(
            f"{unit}: the gate failed reading the records ({exc!r}); please report it", file=stream
        )
    for directory in quarantine_dirs(runtime_dir, state_dir, defaults):
        try:
            path = Quarantine(directory).path(unit)
            path.lstat()
        except Exception:  # noqa: S112 - unseen: a record it cannot name refuses nothing
            continue
        _say(f"{unit}: start refused, quarantined: a record is at {path}", file=stream)
        _say(f"release it with: vllm-supervisor release {unit}", file=stream)
        return EXIT_QUARANTINED
    return None


def _check_records(
    unit: str, runtime_dir: Path, state_dir: Path, defaults: Sequence[Path], stream: TextIO
) -> int | None:
    """EXIT_QUARANTINED (with the reason printed) while a record exists, readable or not.

    A directory the gate cannot search hides no record it could name: the start goes on with
    one line, since the supervisor's own broken state must not take the server down. A record
    that exists but cannot be read or parsed still refuses (fail closed on a record only).
    """
    for directory in quarantine_dirs(runtime_dir, state_dir, defaults):
        quarantine = Quarantine(directory)
        try:
            quarantine.path(unit).lstat()
        except FileNotFoundError:
            continue
        except OSError as exc:
            _say(
                f"{unit}: cannot search {directory} ({exc.strerror}): a quarantine record "
                "there would not be seen; fix its permissions or run the gate as root "
                "(ExecCondition=+...)",
                file=stream,
            )
            continue
        try:
            record = quarantine.read(unit) or {"corrupt": True, "error": "removed while read"}
        except OSError as exc:
            record = {"corrupt": True, "error": f"{quarantine.path(unit)}: {exc.strerror}"}
        if _lifted(unit, quarantine, record, runtime_dir, stream):
            continue
        _say(f"{unit}: start refused, quarantined: {_summary(record)}", file=stream)
        if (holder := still_holds(record)) is not None:
            _say(f"{unit}: {holder}", file=stream)
        if waits_on_a_condition(record):
            _arm_recheck(unit, record, runtime_dir, state_dir, stream)
        _say(f"release it with: vllm-supervisor release {unit}", file=stream)
        return EXIT_QUARANTINED
    return _check_holds(unit, runtime_dir, defaults, stream)


def _arm_recheck(
    unit: str, record: dict[str, Any], runtime_dir: Path, state_dir: Path, stream: TextIO
) -> bool:
    """Have systemd check again, a little later, whether the cause of a halt that can clear
    by itself is gone (`recheck`, which starts the unit then); True once it will."""
    program = _own_program()
    if program is None:
        _say(f"{unit}: it is not checked again by itself: no vllm-supervisor on PATH", file=stream)
        return False
    at = time.time() + _recheck_after_s(record)
    argv = [program, "recheck", "--runtime-dir", str(runtime_dir), "--state-dir", str(state_dir)]
    try:
        arm_recheck_once(unit, at, [*argv, unit])
    except (SystemdError, OSError, TimeoutError) as exc:
        _say(f"{unit}: it is not checked again by itself: systemd said {exc}", file=stream)
        return False
    _say(
        f"{unit}: checked again at {clock_time(at)}; it starts by itself once the cause is gone",
        file=stream,
    )
    return True


def _recheck_after_s(record: dict[str, Any]) -> float:
    """Soon after the halt (a port held for a moment), less often as it lasts."""
    since = record.get("time")
    try:
        age_s = time.time() - datetime.fromisoformat(str(since)).timestamp()
    except (TypeError, ValueError, OverflowError):
        age_s = 0.0
    return min(max(age_s / 4, RECHECK_FIRST_S), RECHECK_MAX_S)


def _own_program() -> str | None:
    """The vllm-supervisor that runs this gate, for the recheck's command line."""
    own = Path(sys.argv[0])
    if own.is_absolute() and own.name == "vllm-supervisor" and os.access(own, os.X_OK):
        return str(own)
    return shutil.which("vllm-supervisor")


def recheck_main(
    unit: str,
    runtime_dir: Path,
    state_dir: Path,
    *,
    out: TextIO | None = None,
    defaults: Sequence[Path] = DEFAULT_DIRS,
) -> int:
    """`recheck UNIT` (run by the timer the gate armed): a halt whose own cause is gone is
    lifted and the unit started; one whose cause holds is checked again later; any other
    halt waits for a person. Never lifts on an environment change: an install may be half done."""
    stream = out if out is not None else sys.stdout
    found = []
    for directory in quarantine_dirs(runtime_dir, state_dir, defaults):
        try:
            record = Quarantine(directory).read(unit)
        except OSError as exc:
            _say(f"{unit}: cannot read {directory}: {exc.strerror}; left as it is", file=stream)
            return 1
        if record is not None:
            found.append((directory, record))
    if not found:
        _say(f"{unit}: no halt to check again", file=stream)
        return 0
    if not all(waits_on_a_condition(record) for _, record in found):
        _say(f"{unit}: halted for good: it waits for a person (release, or a fix)", file=stream)
        return 0
    gone = [cause_gone(record, unit=unit) for _, record in found]
    if any(why is None for why in gone):
        _, record = found[0]
        if (holder := still_holds(record)) is not None:
            _say(f"{unit}: {holder}", file=stream)
        return 0 if _arm_recheck(unit, record, runtime_dir, state_dir, stream) else 1
    for directory, _ in found:
        Quarantine(directory).release(unit)
    _tell_released(unit, runtime_dir)
    _say(f"{unit}: the halt is lifted, {'; '.join(map(str, gone))}", file=stream)
    return _start_now(unit, stream)


def _check_holds(
    unit: str, runtime_dir: Path, defaults: Sequence[Path], stream: TextIO
) -> int | None:
    """EXIT_QUARANTINED while the unit's start is held and systemd holds the start at the
    hold's deadline; None (the start goes on) otherwise."""
    now = time.time()
    try:
        hold = active_hold(unit, hold_dirs(runtime_dir, defaults), now)
    except OSError as exc:
        _say(f"{unit}: cannot read its hold ({exc.strerror}): start allowed", file=stream)
        return None
    if hold is None:
        return None
    when = f"{clock_time(hold.until)} (in {duration(hold.left_s(now))})"
    try:
        timer = arm_once(hold)
    except (SystemdError, OSError, TimeoutError) as exc:
        _say(
            f"{unit}: start allowed: it is held until {when}, but systemd would not take the "
            f"start at that time ({exc}); a hold nothing would end is no hold",
            file=stream,
        )
        return None
    _say(
        f"{unit}: start held until {when}: paced after {hold.crashes} crashes in a row "
        f"({hold.rule or 'unknown rule'}); systemd starts it then ({timer})",
        file=stream,
    )
    _say(f"start it now with: vllm-supervisor release {unit}", file=stream)
    return EXIT_QUARANTINED


def _lifted(
    unit: str, quarantine: Quarantine, record: dict[str, Any], runtime_dir: Path, stream: TextIO
) -> bool:
    """Lift a halt whose cause is gone (the port it found held is free, the missing path
    exists) or whose unit's environment or config changed since (a package upgraded, its
    ExecStart= or an EnvironmentFile= edited): the record is removed, the daemon told, and
    one line says what changed."""
    what = changed(record, unit=unit)
    if what is None:
        return False
    try:
        quarantine.release(unit)
    except OSError as exc:
        _say(f"{unit}: {what}, but the halt cannot be lifted: {exc.strerror}", file=stream)
        return False
    _tell_released(unit, runtime_dir)
    _say(
        f"{unit}: start allowed: the halt is lifted, {what} (was: {_summary(record)})", file=stream
    )
    return True


def release_main(
    unit: str,
    runtime_dir: Path,
    state_dir: Path,
    *,
    out: TextIO | None = None,
    defaults: Sequence[Path] = DEFAULT_DIRS,
) -> int:
    """Remove every quarantine record of `unit`; 0 when it is free afterwards."""
    stream = out if out is not None else sys.stdout
    released = 0
    for directory in quarantine_dirs(runtime_dir, state_dir, defaults):
        try:
            record = Quarantine(directory).release(unit)
        except OSError as exc:
            _say(f"{unit}: cannot release {directory}: {exc.strerror}", file=sys.stderr)
            return 1
        if record is not None:
            released += 1
            _say(f"released {unit} ({directory}): {_summary(record)}", file=stream)
    held = _release_holds(unit, runtime_dir, defaults, stream)
    if released or held:
        _tell_released(unit, runtime_dir)
    if held and not released:
        return _start_now(unit, stream)
    if released:
        _say(f"start it again with: systemctl start {unit}", file=stream)
    else:
        _say(f"{unit} is not quarantined", file=stream)
    return 0


def _release_holds(unit: str, runtime_dir: Path, defaults: Sequence[Path], stream: TextIO) -> bool:
    """End the unit's holds (records and timers); True when one was removed."""
    held = False
    for directory in hold_dirs(runtime_dir, defaults):
        try:
            hold = Holds(directory).remove(unit)
        except OSError as exc:
            _say(f"{unit}: cannot end its hold in {directory}: {exc.strerror}", file=sys.stderr)
            continue
        if hold is not None:
            held = True
            _say(
                f"ended the hold of {unit} ({directory}): it was held until "
                f"{clock_time(hold.until)}",
                file=stream,
            )
    if held:
        try:
            disarm_once(unit)
        except (SystemdError, OSError, TimeoutError) as exc:
            _say(f"{unit}: its held start's timer was not stopped ({exc})", file=sys.stderr)
    return held


def _start_now(unit: str, stream: TextIO) -> int:
    """Start a unit whose hold `release` ended (a hold's start was to come anyway)."""
    try:
        start_once(unit)
    except (SystemdError, OSError, TimeoutError) as exc:
        _say(
            f"{unit}: could not start it ({exc}); start it with: systemctl start {unit}",
            file=sys.stderr,
        )
        return 1
    _say(f"started {unit}", file=stream)
    return 0


def _tell_released(unit: str, runtime_dir: Path) -> None:
    """The running daemon forgets the unit's streak and clears its halted gauge at once; a
    stopped one, when it starts (a mark left beside its socket)."""
    reply = ask(
        socket_path(runtime_dir),
        {"op": "released", "unit": unit},
        timeout_s=RELEASE_NOTIFY_TIMEOUT_S,
    )
    if not reply.reached and note_release(runtime_dir, unit) is None:
        print(
            f"{unit}: the supervisor is not running and the release could not be left for it "
            f"in {runtime_dir}: its next crash counts on the old streak",
            file=sys.stderr,
        )


def _say(text: str, *, file: TextIO) -> None:
    """One line of the gate's (its stream is the unit's journal): a value in it (a record's
    title, a reply, a process's command line, a unit name) shows its control characters
    escaped, so none can start a line of its own that reads as the gate's."""
    file.write(visible(text) + "\n")


def _summary(record: dict[str, Any]) -> str:
    """The record in one line, without its root cause: the gate's lines land in the unit's
    journal, in the next run's, where an echoed `RuntimeError: ...` would read as that run's
    own cause (`vllm-supervisor status UNIT` shows it)."""
    if record.get("corrupt"):
        return f"record is unreadable ({record.get('error')}); treated as quarantined"
    fields: Iterable[str] = (
        f"{key}={record[key]}"
        for key in ("time", "signature", "title", "reason", "invocation_id")
        if record.get(key)
    )
    return "; ".join(fields) or "no details recorded"
