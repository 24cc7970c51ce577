"""The shared retry rule (supervisor.util.retry): doubling, capped, jitter in the upper half."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_supervisor.util.retry import Backoff


def test_doubles_from_the_base_up_to_the_cap() -> None:
    """1, 2, 4, 8, then the cap: the waits the reader, commits, halts and Slack use."""
    backoff = Backoff(1.0, 10.0)
    assert [backoff.delay(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_jitter_stays_in_the_upper_half() -> None:
    """A jittered wait is never shorter than half the plain one, never longer than it."""
    backoff = Backoff(0.2, 5.0, jitter=True)
    rng = random.Random(7)
    waits = [backoff.delay(3, rng) for _ in range(200)]
    assert all(0.4 <= w <= 0.8 for w in waits)
    assert len(set(waits)) > 100  # it does spread


def test_rejects_a_rule_that_cannot_wait() -> None:
    """A zero base or a cap below the base is a configuration error, said at once."""
    with pytest.raises(ValueError, match="0 < base_s <= cap_s"):
        Backoff(0.0, 1.0)
    with pytest.raises(ValueError, match="0 < base_s <= cap_s"):
        Backoff(2.0, 1.0)


@given(
    base=st.floats(min_value=1e-6, max_value=1e3),
    extra=st.floats(min_value=0, max_value=1e6),
    attempt=st.integers(min_value=-10, max_value=10**9),
    jitter=st.booleans(),
    seed=st.integers(),
)
def test_any_attempt_gives_a_bounded_wait(
    base: float, extra: float, attempt: int, jitter: bool, seed: int
) -> None:
    """No attempt count (a retry loop that ran for weeks) overflows or leaves [base/2, cap]."""
    backoff = Backoff(base, base + extra, jitter=jitter)
    wait = backoff.delay(attempt, random.Random(seed))
    assert backoff.base_s / 2 <= wait <= backoff.cap_s
    assert backoff.ceiling(attempt) <= backoff.ceiling(attempt + 1)
