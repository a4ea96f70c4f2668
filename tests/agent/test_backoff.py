"""The one retry policy: exponential, jittered, capped, reset on success, optional give-up."""

import random

from worker_agent.backoff import Backoff


def test_delays_grow_exponentially_within_jitter_bounds_and_cap():
    backoff = Backoff(base=1, factor=2, cap=60, rng=random.Random(7))
    delays = [backoff.next_delay() for _ in range(10)]
    for n, delay in enumerate(delays):
        ceiling = min(60, 2**n)
        assert ceiling / 2 <= delay <= ceiling
    assert max(delays) <= 60
    assert delays[-1] >= 30  # capped, but never collapsed by jitter


def test_jitter_spreads_a_fleet():
    firsts = {round(Backoff(base=8, rng=random.Random(seed)).next_delay(), 3) for seed in range(20)}
    assert len(firsts) > 10


def test_reset_starts_over():
    backoff = Backoff(base=1, rng=random.Random(1))
    for _ in range(6):
        backoff.next_delay()
    backoff.reset()
    assert backoff.failures == 0
    assert backoff.next_delay() <= 1


def test_minimum_honours_retry_after():
    backoff = Backoff(base=1, cap=60, rng=random.Random(1))
    assert backoff.next_delay(minimum=42) == 42
