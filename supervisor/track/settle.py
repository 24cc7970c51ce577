"""Settling: when an ended invocation is decided, once its late lines had their chance.

journald relays a service's stdout through a stream that can lag behind PID 1's own messages
(seen on systemd 252: a crash's last lines logged after "Failed with result"), so an ended
invocation waits `settle_s` before it is decided. Its `Deadline` is that wait on the two clocks
that can end it: the journal's (an entry's time: a backlog read fast runs far ahead of the
reader's clock) and the reader's (a quiet journal, where no later entry comes). A line its
processes still write keeps it open, up to `drain_max_s` after its end; the unit's next start
cuts it to `settle_after_start_s`; and the host's journald can say every line is written
(`Drained`), which ends the wait for every end read before then.

`Deadline.due(now, drained)` is the one question: has the wait ended at `now`?
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import TrackerConfig


@dataclass(frozen=True, slots=True)
class Now:
    """A moment on either clock or both: an entry's journal time (microseconds), the reader's
    monotonic clock (seconds). A clock left None ends no wait."""

    journal_us: int | None = None
    read: float | None = None


@dataclass(frozen=True, slots=True)
class Drained:
    """`host`'s journald had written every line of its dead processes by `read_before`
    (reader's clock), and the reader has read them since."""

    host: str
    read_before: float


@dataclass(frozen=True, slots=True)
class Window:
    """The waits, from the tracker's config, on both clocks."""

    settle_us: int
    settle_s: float
    after_start_us: int
    after_start_s: float
    drain_us: int
    drain_s: float

    @classmethod
    def of(cls, caps: TrackerConfig) -> Window:
        return cls(
            settle_us=int(caps.settle_s * 1_000_000),
            settle_s=caps.settle_s,
            after_start_us=int(caps.settle_after_start_s * 1_000_000),
            after_start_s=caps.settle_after_start_s,
            drain_us=int(caps.drain_max_s * 1_000_000),
            drain_s=caps.drain_max_s,
        )

    @property
    def settles(self) -> bool:
        """False when an end is decided at once (`settle_s` = 0)."""
        return self.settle_us > 0


@dataclass(slots=True)
class Deadline:
    """When an ended invocation is decided: whichever clock passes its mark first."""

    ended_us: int  # the end, in journal time
    end_read: float  # when the end was read, on the reader's clock
    journal_us: int  # decided once an entry this late is read
    read: float  # ... or once the reader's clock passes this

    @classmethod
    def after_end(cls, ended_us: int, read_now: float, window: Window) -> Deadline:
        return cls(
            ended_us=ended_us,
            end_read=read_now,
            journal_us=ended_us + window.settle_us,
            read=read_now + window.settle_s,
        )

    def still_writing(self, line_us: int, read_now: float, window: Window) -> None:
        """A line of the ended invocation was read: journald is still writing what its
        processes printed, so wait `settle_s` more, up to `drain_max_s` after its end."""
        self.journal_us = min(
            max(self.journal_us, line_us + window.settle_us), self.ended_us + window.drain_us
        )
        self.read = min(max(self.read, read_now + window.settle_s), self.end_read + window.drain_s)

    def cut(self, start_us: int, read_now: float, window: Window) -> None:
        """The unit started again: the ended run's processes are gone, wait only a little."""
        self.journal_us = min(self.journal_us, start_us + window.after_start_us)
        self.read = min(self.read, read_now + window.after_start_s)

    def due(self, now: Now, drained: Drained | None = None) -> bool:
        """Has the wait ended at `now`, or was the end read before the host drained?"""
        return (
            (now.journal_us is not None and self.journal_us <= now.journal_us)
            or (now.read is not None and self.read <= now.read)
            or (drained is not None and self.end_read <= drained.read_before)
        )
