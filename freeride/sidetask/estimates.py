"""Step-time estimates: a running estimate per step kind, and one from relative cost for kinds not yet measured."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable

__all__ = ["TRUSTED_RUNS", "Calibration", "StepCost", "StepEstimates", "StepEstimator"]


class StepEstimator:
    """Conservative running estimate of the next step's duration.

    The 90th percentile (nearest rank) of the last ``window`` measured steps:
    a lasting slowdown shows at once, while a single outlier (a step that was
    preempted, the first step's warm-up) does not shut the task out of every
    bubble. Until a step has been measured it uses the hint (or ``-1``).
    """

    def __init__(self, hint_ns: int = -1, *, window: int = 16) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.hint_ns = hint_ns
        self._recent: deque[int] = deque(maxlen=window)

    def observe(self, duration_ns: int) -> None:
        self._recent.append(duration_ns)

    @property
    def measured(self) -> bool:
        """Whether a step has been measured (or restored from an earlier run)."""
        return bool(self._recent)

    def recent(self) -> list[int]:
        """The measured durations the estimate is taken over, oldest first."""
        return list(self._recent)

    @property
    def estimate_ns(self) -> int:
        """The estimate, or -1 if nothing is known yet."""
        if not self._recent:
            return self.hint_ns
        ordered = sorted(self._recent)
        return ordered[int(0.9 * (len(ordered) - 1))]


_NEAR = 16
"""Measured kinds within this factor of an unmeasured kind's cost estimate it (see :class:`StepEstimates`)."""

TRUSTED_RUNS = 8
"""Steps of a kind measured in bubbles after which its own percentile stands alone (see :class:`Calibration`)."""


class Calibration:
    """How far steps of kinds measured only a few times ran past their estimate: the 90th percentile ratio.

    A kind's estimate from a few samples runs low: its percentile is one of
    them, and samples taken back to back in a rehearsal (the warm-up, with no
    training beside it) miss what a step in a bubble pays after the stage ran
    (caches it left cold, memory it keeps busy). A partitioned VGG-19 on CPU
    has ~370 kinds that each run a few times a run; 88 % of their steps in
    bubbles took longer than the estimate from two rehearsed ones, by 26 % at
    the median and 73 % at the 90th percentile. Each step of a kind measured in
    bubbles fewer than :data:`TRUSTED_RUNS` times adds its time over the
    estimate it had; such kinds' estimates are scaled by the 90th percentile of
    the last ``window`` ratios, once ``least`` are known, and never scaled down.
    """

    def __init__(self, *, window: int = 128, least: int = 16) -> None:
        self._ratios: deque[float] = deque(maxlen=window)
        self._least = least
        self.factor = 1.0
        """What the estimate of a kind measured only a few times is multiplied by (at least 1)."""

    def add(self, took_ns: int, estimate_ns: int) -> None:
        """A step of a little-measured kind took ``took_ns`` against its (unscaled) estimate ``estimate_ns``."""
        if estimate_ns <= 0 or took_ns <= 0:
            return
        self._ratios.append(took_ns / estimate_ns)
        if len(self._ratios) >= self._least:
            ordered = sorted(self._ratios)
            self.factor = max(1.0, ordered[int(0.9 * (len(ordered) - 1))])


StepCost = Callable[[str], float | None]
"""Relative work of a step of a kind, or None (see :meth:`IterativeTask.step_cost`)."""


class StepEstimates:
    """One :class:`StepEstimator` per step kind; the hint applies to the default kind ``""``.

    A kind with no measurement (and no hint) is estimated from its ``cost``, if
    the task gives one, and the measured kinds nearest in cost (within 16x):

    * from smaller kinds, in proportion to cost. Steps pay a fixed part
      (launches, Python) besides their work, so this errs high;
    * from larger kinds only where there is no smaller one, in proportion to the
      square root of the cost ratio: half the work takes 71 % of the time, a
      quarter 50 %, which errs high unless the fixed part dominates;

    the 90th percentile of those (rounded up: the largest of up to ten), and no
    less than any smaller kind measured. A tiny kind, mostly fixed part, never
    scales a large one. Erring high keeps a kind out of a few bubbles it would
    have fit; erring low would run a step past a bubble's end, into training.

    A kind measured in bubbles fewer than :data:`TRUSTED_RUNS` times has its
    estimate scaled by what such kinds' steps took over theirs
    (:class:`Calibration`); steps rehearsed outside bubbles
    (``observe(..., rehearsal=True)``) count as measured but teach it nothing.
    """

    def __init__(self, hint_ns: int = -1, *, window: int = 16, cost: StepCost | None = None) -> None:
        self._window = window
        self._by_kind: dict[str, StepEstimator] = {"": StepEstimator(hint_ns, window=window)}
        self._cost = cost
        self._costs: dict[str, float | None] = {}
        self._points: dict[str, tuple[int, float]] = {}
        """Measured kinds with a cost: (estimate, cost)."""
        self._scaled: dict[str, int] = {}
        """Cost-scaled estimates of unmeasured kinds, until the next measurement."""
        self._first: dict[str, int] = {}
        """The first measured step of each kind in this run."""
        self._cold: dict[str, int] = {}
        """Seeded kinds not yet run in this run: their first step's time in the run that measured them."""
        self._runs: dict[str, int] = {}
        """Steps of each kind measured in bubbles in this run (rehearsals left out)."""
        self.calibration = Calibration()

    def _of(self, kind: str) -> StepEstimator:
        estimator = self._by_kind.get(kind)
        if estimator is None:
            estimator = self._by_kind[kind] = StepEstimator(window=self._window)
        return estimator

    def _measured_now(self, kind: str, estimator: StepEstimator) -> None:
        cost = self._cost_of(kind)
        if cost is not None:
            self._points[kind] = (estimator.estimate_ns, cost)
            self._scaled.clear()

    def observe(self, kind: str, duration_ns: int, *, rehearsal: bool = False) -> None:
        """Learn that a step of ``kind`` took ``duration_ns``.

        Args:
            kind: The step kind.
            duration_ns: What it took.
            rehearsal: It ran outside any bubble, back to back with others (the
                warm-up): it counts as measured, but says nothing of how far
                estimates from a few samples fall short in bubbles.
        """
        estimator = self._of(kind)
        if not rehearsal:
            runs = self._runs.get(kind, 0)
            if runs < TRUSTED_RUNS and estimator.measured and kind not in self._cold:  # a cold step: warm-up
                self.calibration.add(duration_ns, estimator.estimate_ns)
            self._runs[kind] = runs + 1
        estimator.observe(duration_ns)
        self._first.setdefault(kind, duration_ns)
        self._cold.pop(kind, None)
        self._measured_now(kind, estimator)

    def seed(self, kind: str, durations_ns: Iterable[int], *, first_ns: int = -1) -> None:
        """Take ``durations_ns`` (from an earlier run) as measured; new measurements displace them.

        Args:
            kind: The step kind.
            durations_ns: Its recent step times, oldest first.
            first_ns: The first step of the kind in that run, warm-up included
                (see :meth:`cold_ns`).
        """
        estimator = self._of(kind)
        for duration in durations_ns:
            if duration > 0:
                estimator.observe(duration)
        if first_ns > 0 and kind not in self._first:
            self._cold[kind] = first_ns
        if estimator.measured:
            self._measured_now(kind, estimator)

    def first_ns(self, kind: str) -> int:
        """The first step of ``kind`` measured in this run, else the one seeded, else -1."""
        return self._first.get(kind, self._cold.get(kind, -1))

    def cold_ns(self, kind: str) -> int:
        """How long the first step of a seeded ``kind`` took in the run that measured it, until one runs here.

        A fresh process pays a kind's warm-up (caches, allocations, kernel
        selection) again on its first step of the kind; -1 once that step has
        run here, or if nothing was seeded.
        """
        return self._cold.get(kind, -1)

    def recent(self) -> dict[str, list[int]]:
        """The measured durations of every measured kind (what an estimates file keeps)."""
        return {kind: e.recent() for kind, e in self._by_kind.items() if e.measured}

    def measured(self, kind: str) -> bool:
        """Whether a step of ``kind`` was measured (or restored from an earlier run)."""
        estimator = self._by_kind.get(kind)
        return estimator is not None and estimator.measured

    def _cost_of(self, kind: str) -> float | None:
        if self._cost is None:
            return None
        if kind not in self._costs:
            cost = self._cost(kind)
            self._costs[kind] = float(cost) if cost is not None and math.isfinite(cost) and cost > 0 else None
        return self._costs[kind]

    def _cost_scaled(self, cost: float) -> int:
        points = list(self._points.values())
        if not points:
            return -1
        smaller = [(t, c) for t, c in points if c <= cost]
        larger = [(t, c) for t, c in points if c > cost]
        near = [(t, c) for t, c in smaller if c * _NEAR >= cost]
        if near or not larger:
            scaled = [t * cost / c for t, c in near or smaller]
        else:
            scaled = [t * math.sqrt(cost / c) for t, c in [(t, c) for t, c in larger if c <= cost * _NEAR] or larger]
        scaled.sort()
        estimate = scaled[math.ceil(0.9 * (len(scaled) - 1))]
        return math.ceil(max([estimate, *(t for t, _ in smaller)]))

    def _own_ns(self, kind: str, estimator: StepEstimator) -> int:
        estimate = estimator.estimate_ns
        factor = self.calibration.factor
        if factor > 1.0 and estimator.measured and self._runs.get(kind, 0) < TRUSTED_RUNS:
            return math.ceil(estimate * factor)
        return estimate

    def known_ns(self, kind: str = "") -> int:
        """The estimate for a step of ``kind`` from its measurements or the hint; -1 without (cost ignored)."""
        estimator = self._by_kind.get(kind)
        return -1 if estimator is None else self._own_ns(kind, estimator)

    def estimate_ns(self, kind: str = "") -> int:
        """The estimate for a step of ``kind``, or -1 if nothing is known yet."""
        estimator = self._by_kind.get(kind)
        if estimator is not None and (estimator.measured or estimator.hint_ns >= 0):
            return self._own_ns(kind, estimator)
        scaled = self._scaled.get(kind)
        if scaled is None:
            cost = self._cost_of(kind)
            scaled = self._scaled[kind] = -1 if cost is None else self._cost_scaled(cost)
        return scaled

    def kinds(self) -> list[str]:
        return list(self._by_kind)
