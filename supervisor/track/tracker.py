"""The invocation tracker: groups journal entries into starts of a unit and sees each one end.

An invocation is one start of a unit on one machine, named by systemd's invocation id
(`_SYSTEMD_INVOCATION_ID` on the service's lines, `INVOCATION_ID` on PID 1's messages). Entries
are attributed to their machine (`_MACHINE_ID`): a journal directory may hold several hosts, and
each host's units are tracked apart, each by its own state machine (supervisor.track.invocations:
how an invocation ends). What an invocation keeps of its lines is supervisor.track.retention;
when an ended one is decided, after its late lines, is supervisor.track.settle.

The tracker is the one memory of which invocation is open or closed and whether it served: the
daemon's hooks ask it (`open_invocation`, `has_seen`) instead of keeping their own. It is
*total*: no content and no order of entries raises. Every invocation is returned exactly once,
and no entry lands in two invocations.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..config import TrackerConfig
from ..model import Ending, Invocation, JournalEntry, LifecycleEvent
from .invocations import Context, Run, SuppressionNotice, UnitRuns
from .settle import Drained, Now, Window

__all__ = ["Drained", "InvocationTracker", "Now", "SuppressionNotice"]

Key = tuple[str, str | None]  # (machine id or "", unit)

# journald's own notice, read per entry: a plain string, as an enum member's lookup costs more.
_SUPPRESSED: str = LifecycleEvent.SUPPRESSED.value


# The run the last service line joined (unit, host, invocation id, its unit's runs, the run):
# most lines are one more line of it. A tuple: it is made for nearly every line.
_Fed = tuple[str | None, str | None, str | None, UnitRuns, Run]


class InvocationTracker:
    """Feeds on journal entries; returns each invocation as it ends, exactly once."""

    def __init__(
        self, caps: TrackerConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.caps = caps or TrackerConfig()
        self._context = Context(caps=self.caps, window=Window.of(self.caps), clock=clock)
        self._seq = self._context.seq
        self._units: dict[Key, UnitRuns] = {}
        self._notices: list[SuppressionNotice] = []
        self._fed: _Fed | None = None

    @property
    def late_lines(self) -> int:
        """Lines of invocations already returned (dropped)."""
        return sum(runs.late_lines for runs in self._units.values())

    # -- feeding ----------------------------------------------------------------------------

    def feed(self, entry: JournalEntry) -> list[Invocation]:
        """Account for one entry; return the invocations it ended (usually none)."""
        fed = self._fed
        if (
            fed is not None
            and entry.message_id is None
            and not entry.from_pid1
            and entry.unit == fed[0]
            and entry.host == fed[1]
            and entry.invocation_id == fed[2]
            and not fed[3].settling
            and not fed[4].closed
            and (entry.boot_id is None or entry.boot_id == fed[4].boot_id)
        ):
            # The common case, a shortcut of the path below (which does the same with it): one
            # more line of the running invocation, none of its unit's ended ones settling.
            fed[4].add_line(self._seq(), entry)
            return []
        return self._feed(entry)

    def _feed(self, entry: JournalEntry) -> list[Invocation]:
        key: Key = (entry.host or "", entry.unit)
        runs = self._units.get(key)
        if runs is None:
            runs = self._units[key] = UnitRuns(entry.unit, self._context)
        ended: list[Invocation] = []
        suppressed = entry.message_id == _SUPPRESSED
        if runs.settling:
            if not entry.from_pid1 and not suppressed:
                runs.still_writing(entry)
            ended += runs.due(Now(journal_us=entry.realtime_us))
        if entry.boot_id is not None and entry.boot_id != runs.boot_id:
            ended += runs.new_boot(entry.boot_id)
        if suppressed:
            notice = runs.suppressed(entry)
            if notice is not None:
                self._notices.append(notice)
        elif entry.from_pid1:
            ended += runs.lifecycle(entry)
        else:
            ended += runs.line(entry)
            if runs.fed is not None:
                self._fed = (entry.unit, entry.host, entry.invocation_id, runs, runs.fed)
        return ended

    # -- time passing -------------------------------------------------------------------------

    def due(self, now: Now, drained: Drained | None = None) -> list[Invocation]:
        """Ended invocations whose wait for late lines is over at `now` (either clock), and,
        with `drained`, those of its host whose end was read before it drained: every line
        their processes printed had reached the journal by then and has been read since."""
        ended: list[Invocation] = []
        for (host, _), runs in self._units.items():
            ended += runs.due(now, drained if drained and drained.host == host else None)
        return ended

    def settling_on(self, host: str) -> bool:
        """Does an ended invocation of `host` wait for late lines?"""
        return any(runs.settling for (on, _), runs in self._units.items() if on == host)

    def next_deadline(self) -> float | None:
        """When the next ended invocation becomes ready (reader's clock), if any is waiting."""
        deadlines = [
            run.settle.read
            for runs in self._units.values()
            for run in runs.settling.values()
            if run.settle is not None
        ]
        return min(deadlines, default=None)

    # -- ending on demand ------------------------------------------------------------------

    def close(
        self,
        unit: str | None,
        host: str | None,
        invocation_id: str | None,
        ending: Ending,
        *,
        end_message: str | None = None,
    ) -> Invocation | None:
        """End a running invocation now (the daemon saw its engine hang, or its server exit
        under RemainAfterExit=: `end_message` says how); None if not running."""
        runs = self._units.get((host or "", unit))
        if runs is None:
            return None
        run = runs.running.get(invocation_id) or (
            runs.newest_running() if invocation_id is None else None
        )
        if run is None:
            return None
        if end_message is not None:
            run.end_message = end_message
        return runs.close(run, ending)

    def close_all(self) -> list[Invocation]:
        """End every invocation (the end of a saved journal): settling ones as they ended,
        running ones as still open."""
        ended: list[Invocation] = []
        for runs in self._units.values():
            ended += [runs.close(r) for r in list(runs.settling.values())]
            ended += [runs.close(r, Ending.OPEN) for r in list(runs.running.values())]
        return ended

    # -- views ---------------------------------------------------------------------------------

    def open_invocation(self, unit: str | None, host: str | None = None) -> Invocation | None:
        """A snapshot of a unit's running invocation, without ending it."""
        for (on, name), runs in self._units.items():
            if name == unit and (host is None or on == (host or "")):
                run = runs.newest_running()
                if run is not None:
                    return run.build(Ending.OPEN)
        return None

    def newest_invocation_id(self, unit: str | None, host: str | None = None) -> str | None:
        """The id of a unit's newest invocation read (on `host`), ended or not."""
        for (on, name), runs in self._units.items():
            if name == unit and (host is None or on == (host or "")):
                found = runs.newest_id()
                if found is not None:
                    return found
        return None

    def running_starts(self, host: str = "") -> dict[str, tuple[int | None, int | None]]:
        """(started, served) of each unit's running invocation on `host` (a machine id; "":
        any), realtime microseconds; a unit with none running is absent. `started` is None
        unless PID 1's start of it was read: its first line read is not its start after a
        daemon restart at the tail or a vacuumed start."""
        starts: dict[str, tuple[int | None, int | None]] = {}
        for (on, unit), runs in self._units.items():
            if host and on and on != host:
                continue  # another machine's journal in the same directory
            run = runs.newest_running()
            if unit is not None and run is not None and unit not in starts:
                starts[unit] = (run.started_us if run.start_seen else None), run.served_us
        return starts

    def running_phases(self, host: str = "") -> dict[str, str]:
        """The start phase (`[[phase]]`) each unit's running invocation on `host` last named,
        for those not serving yet that named one."""
        phases: dict[str, str] = {}
        for (on, unit), runs in self._units.items():
            if host and on and on != host:
                continue
            run = runs.newest_running()
            if unit is not None and run is not None and run.served_us is None and run.phase:
                phases.setdefault(unit, run.phase)
        return phases

    def forget_all_but(self, units: frozenset[str]) -> None:
        """Drop what is kept of every other unit (a reload stopped supervising it): none of
        its entries is read meanwhile, so a run of it kept now would be stale if it came back."""
        for key in [key for key in self._units if key[1] not in units]:
            del self._units[key]
        if self._fed is not None and self._fed[0] not in units:
            self._fed = None

    def has_seen(self, unit: str | None, invocation_id: str) -> bool:
        """True once an entry of that invocation of `unit` was read (on any host)."""
        return any(
            name == unit
            and (runs.run_of(invocation_id) is not None or invocation_id in runs.closed)
            for (_, name), runs in self._units.items()
        )

    def settling(self, unit: str | None) -> bool:
        """True while an ended invocation of `unit` still waits for its late lines."""
        return any(name == unit and runs.settling for (_, name), runs in self._units.items())

    def take_notices(self) -> list[SuppressionNotice]:
        """journald's late reports of lost lines, since the last call."""
        notices, self._notices = self._notices, []
        return notices

    def replay_from(self) -> str | None:
        """The first cursor of the oldest invocation in flight: where a restart re-reads from."""
        runs = [
            r
            for unit in self._units.values()
            for r in (*unit.running.values(), *unit.settling.values())
            if r.first_cursor is not None
        ]
        if not runs:
            return None
        return min(runs, key=lambda r: r.started_us or 0).first_cursor
