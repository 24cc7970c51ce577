"""Reading again after a restart: entries up to the saved cursor rebuild the open invocations.

The checkpoint's `replay_from` is the first entry of the oldest invocation still open when it
was committed; reading restarts there so that invocation's lines are tracked again, and nothing
up to the saved `cursor` is decided a second time (supervisor.store.Checkpoint).
"""

from __future__ import annotations

import structlog

from ..journal.reader import cursor_realtime_us
from ..model import JournalEntry
from ..pipeline import Pipeline
from ..store import Checkpoint

log = structlog.get_logger(__name__)


class Replay:
    """Feeds the entries read again to the pipeline's replay and hands on only the new ones."""

    def __init__(self, checkpoint: Checkpoint, pipeline: Pipeline) -> None:
        self.until = checkpoint.cursor if checkpoint.replay_from else None
        self._pipeline = pipeline

    @property
    def active(self) -> bool:
        """True until the saved cursor is passed: that cursor still stands."""
        return self.until is not None

    def new_entries(
        self, batch: list[JournalEntry], *, cursor_rejected: bool
    ) -> list[JournalEntry]:
        """The entries of `batch` after the saved cursor; those up to it are replayed."""
        if self.until is None:
            return batch
        if cursor_rejected:
            # The saved cursor cannot be found (another journal, corrupt): there is nothing to
            # replay up to, and waiting for it would drop every batch from now on.
            log.warning("replay_abandoned", cursor=self.until)
            self.until = None
            return batch
        for index, entry in enumerate(batch):
            if _after(entry.cursor, self.until):
                # The saved entry was vacuumed: this one is new, to be decided, not replayed.
                self.until = None
                log.info("replay_done", cursor=entry.cursor)
                return batch[index:]
            self._pipeline.replay(entry)
            if entry.cursor == self.until:
                self.until = None
                log.info("replay_done", cursor=entry.cursor)
                return batch[index + 1 :]
        return []


def _after(cursor: str, saved: str) -> bool:
    """True when `cursor` lies after `saved` in time (used when `saved` was vacuumed)."""
    a, b = cursor_realtime_us(cursor), cursor_realtime_us(saved)
    return a is not None and b is not None and a > b
