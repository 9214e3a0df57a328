"""Expected bubble durations: the schedule's prediction, then what was measured.

A rank knows where it will wait from its schedule (see :mod:`freeride.schedule`)
and, after the first step, how long each of those waits lasted. The predictor
keys each wait by its place in the step (for example the action it precedes)
and predicts the median of the last few measurements, falling back to the
schedule's (or a profile's) prior for waits not seen yet.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable

__all__ = ["BubblePredictor"]


class BubblePredictor:
    """Per-position running estimate of bubble durations."""

    def __init__(self, *, history: int = 3) -> None:
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        self._history = history
        self._seen: dict[Hashable, deque[int]] = {}
        self._prior: dict[Hashable, int] = {}

    def set_prior(self, key: Hashable, expected_ns: int) -> None:
        """What the schedule or a profile predicts for ``key`` before any measurement."""
        self._prior[key] = expected_ns

    def expect(self, key: Hashable) -> int:
        """Expected duration of the wait at ``key`` in ns, or -1 if nothing is known."""
        seen = self._seen.get(key)
        if seen:
            return int(statistics.median(seen))
        return self._prior.get(key, -1)

    def observe(self, key: Hashable, duration_ns: int) -> None:
        """Record a measured wait."""
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = deque(maxlen=self._history)
        seen.append(duration_ns)

    def keys(self) -> list[Hashable]:
        return list(self._seen.keys() | self._prior.keys())
