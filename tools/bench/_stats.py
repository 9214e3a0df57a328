"""Statistics of the pipeline benchmarks: paired slowdowns, their bootstrap interval, the verdict.

A benchmark runs the training job in pairs (alone and with side tasks, or
alone twice for an A/A control) and compares, per pair, one figure of the two
runs (the median step time, or the CPU time per step). The slowdown of a pair
is ``b / a - 1``; over the pairs the benchmark reports the median, a bootstrap
95 % interval of that median and whether the interval lies below a goal::

    est = paired_slowdown([(500.0, 502.0), (510.0, 509.0), ...])
    print(est.median, est.low, est.high, verdict(est, goal=0.005))

Everything here is pure and deterministic (the bootstrap is seeded), so the
unit tests pin it with known inputs.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "GOAL",
    "Estimate",
    "Verdict",
    "bootstrap_median_ci",
    "paired_slowdown",
    "verdict",
    "verdict_text",
]

GOAL = 0.005
"""The slowdown the runtime may cost a training job: 0.5 %."""

Verdict = Literal["below", "above", "straddles"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    """The median of some values and a bootstrap confidence interval of that median."""

    median: float
    low: float
    """Lower end of the interval."""
    high: float
    """Upper end of the interval."""
    n: int
    """Values behind it."""
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if not self.low <= self.median <= self.high:
            raise ValueError(f"interval [{self.low}, {self.high}] must contain the median {self.median}")

    @property
    def half_width(self) -> float:
        """Half the interval's width: how finely these values resolve a difference."""
        return (self.high - self.low) / 2


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile ``q`` in [0, 1] of non-empty sorted values."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def bootstrap_median_ci(
    values: Sequence[float], *, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> Estimate:
    """The median of ``values`` and a percentile-bootstrap interval of it.

    Resamples ``values`` with replacement ``resamples`` times (from a
    :class:`random.Random` seeded with ``seed``: the same input gives the same
    interval), takes each resample's median and returns the central
    ``confidence`` share of those medians, widened if need be to contain the
    sample median.

    Raises:
        ValueError: no values, ``confidence`` not in (0, 1) or ``resamples`` < 1.
    """
    if not values:
        raise ValueError("values must not be empty")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    data = [float(v) for v in values]
    mid = statistics.median(data)
    rng = random.Random(seed)
    n = len(data)
    medians = sorted(statistics.median(rng.choices(data, k=n)) for _ in range(resamples))
    tail = (1 - confidence) / 2
    low = min(_quantile(medians, tail), mid)
    high = max(_quantile(medians, 1 - tail), mid)
    return Estimate(median=mid, low=low, high=high, n=n, confidence=confidence)


def paired_slowdown(
    pairs: Sequence[tuple[float, float]], *, confidence: float = 0.95, resamples: int = 10_000, seed: int = 0
) -> Estimate:
    """Slowdown ``b / a - 1`` per pair ``(a, b)``: its median and bootstrap interval.

    For a benchmark pair ``a`` is the run alone and ``b`` the run with side
    tasks; for an A/A control pair both ran alone, and the interval is the
    noise floor: what this machine shows when nothing changed.

    Raises:
        ValueError: no pairs, or a figure that is not positive.
    """
    if not pairs:
        raise ValueError("pairs must not be empty")
    for a, b in pairs:
        if a <= 0 or b <= 0:
            raise ValueError(f"paired figures must be > 0, got ({a}, {b})")
    ratios = [b / a - 1 for a, b in pairs]
    return bootstrap_median_ci(ratios, confidence=confidence, resamples=resamples, seed=seed)


def verdict(estimate: Estimate, goal: float = GOAL) -> Verdict:
    """Where the interval lies against ``goal``: wholly ``below`` it, wholly ``above``, or ``straddles`` it.

    An interval that ends exactly at the goal counts as below it (the goal is
    "at most"); one that starts exactly there straddles it.
    """
    if estimate.high <= goal:
        return "below"
    if estimate.low > goal:
        return "above"
    return "straddles"


def verdict_text(estimate: Estimate, goal: float = GOAL) -> str:
    """The verdict as what "the interval ..." does: ``lies below the 0.5 % goal``, ``straddles the 0.5 % goal``..."""
    goal_text = f"{goal:.1%}".replace("%", " %")
    where = verdict(estimate, goal)
    return f"{'straddles' if where == 'straddles' else 'lies ' + where} the {goal_text} goal"
