"""Expected bubble durations: the schedule's prediction, then what was measured.

A rank knows where it will wait from its schedule (see :mod:`freeride.backends.schedule`)
and, after the first step, how long each of those waits lasted. The predictor
keys each wait by its place in the step (for example the action it precedes)
and predicts from the last few measurements, falling back to the schedule's
(or a profile's) prior for waits not seen yet.

It errs low: a bubble predicted too long lets a side-task step start that
then runs into the training step, while one predicted too short only leaves
some of the bubble unused. Two policies:

* ``"min"``, the shortest of the last ``history`` waits, for the framework
  backends (:mod:`freeride.backends.tracker`), whose waits are noisy: a
  prediction too long costs interference, one too short only unused time.
* ``"low"`` (the default), the second shortest of the last eight, for waits
  that are steady but for rare outliers (the simulated stages, which sleep):
  one early wake-up no longer sets the next three predictions short.

Decision D41 has the figures behind both.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable
from typing import Literal

__all__ = ["BubblePredictor"]

_LOW_AFTER = 4
"""Waits seen before ``"low"`` leaves one out (with fewer, the shortest)."""


class BubblePredictor:
    """Per-position running estimate of bubble durations."""

    def __init__(self, *, history: int = 8, policy: Literal["low", "min", "median"] = "low") -> None:
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        if policy not in ("low", "min", "median"):
            raise ValueError(f"policy must be 'low', 'min' or 'median', got {policy!r}")
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
        if not seen:
            return self._prior.get(key, -1)
        if self._policy == "median":
            return int(statistics.median(seen))
        if self._policy == "low" and len(seen) >= _LOW_AFTER:
            return sorted(seen)[1]  # the second shortest: one outlier does not count
        return min(seen)

    def observe(self, key: Hashable, duration_ns: int) -> None:
        """Record a measured wait."""
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = deque(maxlen=self._history)
        seen.append(duration_ns)

    def keys(self) -> list[Hashable]:
        return list(self._seen.keys() | self._prior.keys())
