"""Expected bubble durations: the schedule's prediction, then what was measured.

A rank knows where it will wait from its schedule (see :mod:`backends.schedule`)
and, after the first step, how long each of those waits lasted. The predictor
keys each wait by its place in the step (for example the action it precedes)
and predicts from the last few measurements, falling back to the schedule's
(or a profile's) prior for waits not seen yet.

It errs low by default (the shortest recent wait): a bubble predicted too long
lets a side-task step start that then runs into the training step, while one
predicted too short only leaves some of the bubble unused. (Replayed over a
loaded DeepSpeed run, the minimum of three halved the over-predicted time
compared with the median, for twice the under-predicted time.)
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable
from typing import Literal

__all__ = ["BubblePredictor"]


class BubblePredictor:
    """Per-position running estimate of bubble durations."""

    def __init__(self, *, history: int = 3, policy: Literal["min", "median"] = "min") -> None:
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        if policy not in ("min", "median"):
            raise ValueError(f"policy must be 'min' or 'median', got {policy!r}")
        self._history = history
        self._policy = policy
        self._seen: dict[Hashable, deque[int]] = {}
        self._prior: dict[Hashable, int] = {}

    def set_prior(self, key: Hashable, expected_ns: int) -> None:
        """What the schedule or a profile predicts for ``key`` before any measurement."""
        self._prior[key] = expected_ns

    def expect(self, key: Hashable) -> int:
        """Expected duration of the wait at ``key`` in ns, or -1 if nothing is known."""
        seen = self._seen.get(key)
        if seen:
            return min(seen) if self._policy == "min" else int(statistics.median(seen))
        return self._prior.get(key, -1)

    def observe(self, key: Hashable, duration_ns: int) -> None:
        """Record a measured wait."""
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = deque(maxlen=self._history)
        seen.append(duration_ns)

    def keys(self) -> list[Hashable]:
        return list(self._seen.keys() | self._prior.keys())
