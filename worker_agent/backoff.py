"""One retry policy for the whole agent: exponential backoff with jitter, a cap, reset on success."""

import random


class Backoff:
    """Delays for consecutive failures: ``base * factor**n`` capped at ``cap``, jittered.

    ``next_delay()`` returns the delay before the next try and counts a failure; ``reset()`` after a
    success starts over.
    The jitter is "equal jitter": half the delay is fixed, half random, so a fleet that lost the
    orchestrator at once does not come back in lockstep, yet no delay collapses to zero.
    """

    def __init__(self, *, base=1.0, factor=2.0, cap=60.0, rng=None):
        self.base = base
        self.factor = factor
        self.cap = cap
        self._rng = rng or random.Random()
        self.failures = 0

    def next_delay(self, minimum=0.0):
        """Count a failure and return how long to wait before the next try (at least ``minimum``)."""
        ceiling = min(self.cap, self.base * self.factor**self.failures)
        self.failures += 1
        delay = ceiling / 2 + self._rng.uniform(0, ceiling / 2)
        return max(delay, min(minimum, self.cap * 5))

    def reset(self):
        """Forget past failures (call after a success)."""
        self.failures = 0
