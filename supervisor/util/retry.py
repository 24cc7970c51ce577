"""The one retry rule: capped exponential backoff, with jitter where many retry at once.

Every retrying part of the daemon waits by it: the journal reader's restarts, the state
commits after a disk error, systemd calls (`actions.halt`), Slack deliveries (`notify.outbox`).
The shape is Alertmanager's retry stage: the n-th wait is `base_s * 2**(n-1)`, at most `cap_s`;
with jitter it is drawn from the upper half of that ("equal jitter"), so retries spread out but
never come sooner than half the plain delay.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_MAX_DOUBLINGS = 64  # 2**64 times any base is past every cap: no float overflow after that
_SHARED_RNG = random.Random()  # noqa: S311 - jitter, not cryptography


@dataclass(frozen=True, slots=True)
class Backoff:
    """The wait before retry number `attempt` (1 for the first retry)."""

    base_s: float
    cap_s: float
    jitter: bool = False

    def __post_init__(self) -> None:
        if not (self.base_s > 0 and self.cap_s >= self.base_s):
            raise ValueError(f"backoff needs 0 < base_s <= cap_s, got {self.base_s}, {self.cap_s}")

    def ceiling(self, attempt: int) -> float:
        """The plain (unjittered) wait before retry `attempt`."""
        doublings = min(max(attempt, 1) - 1, _MAX_DOUBLINGS)
        return min(self.cap_s, self.base_s * 2.0**doublings)

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait before retry `attempt`: the ceiling, or a draw from its upper half."""
        ceiling = self.ceiling(attempt)
        if not self.jitter:
            return ceiling
        return ceiling / 2 + (rng or _SHARED_RNG).uniform(0, ceiling / 2)
