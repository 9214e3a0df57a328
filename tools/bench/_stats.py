"""Statistics of the pipeline benchmarks: paired slowdowns, an order-statistic interval of their median, the verdict.

A benchmark runs the training job in pairs (alone and with side tasks, or
alone twice for an A/A control) and compares, per pair, one figure of the two
runs (the median step time, or the CPU time per step). The slowdown of a pair
is ``b / a - 1``; over the pairs the benchmark reports the median, a
distribution-free 95 % interval of that median (the sign-test interval of
:func:`freeride.observe.stats.median_interval`: two order statistics of the
slowdowns, with a guaranteed coverage) and whether the interval lies below a
goal::

    est = paired_slowdown([(500.0, 502.0), (510.0, 509.0), ...])
    print(est.median, est.low, est.high, est.coverage, verdict(est, goal=0.005))

With too few pairs for the confidence asked (5 or fewer at 95 %) the interval
is the whole range of the slowdowns and ``coverage`` is below ``confidence``:
reports say so. This replaced a seeded percentile bootstrap, which at 6-12
pairs covers well short of what it claims (about 87 % at 7 pairs for 95 %).

Everything here is pure and deterministic, so the unit tests pin it with known
inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from freeride.observe.stats import MedianInterval, median_interval, pairs_needed

__all__ = [
    "GOAL",
    "Estimate",
    "Verdict",
    "paired_slowdown",
    "pairs_needed",
    "verdict",
    "verdict_text",
]

GOAL = 0.005
"""The slowdown the runtime may cost a training job: 0.5 %."""

Verdict = Literal["below", "above", "straddles"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate(MedianInterval):
    """The median of some values and a distribution-free confidence interval of that median.

    A :class:`freeride.observe.stats.MedianInterval` (its fields and checks) that also keeps the
    confidence asked for: ``coverage`` is at least ``confidence``, unless ``n`` is too small for it
    (then the interval is the whole range of the values and ``coverage`` is what that range covers).
    """

    confidence: float = 0.95
    """The coverage asked for."""


def paired_slowdown(pairs: Sequence[tuple[float, float]], *, confidence: float = 0.95) -> Estimate:
    """Slowdown ``b / a - 1`` per pair ``(a, b)``: its median and order-statistic interval.

    For a benchmark pair ``a`` is the run alone and ``b`` the run with side
    tasks; for an A/A control pair both ran alone, and the interval is the
    noise floor: what this machine shows when nothing changed. The interval is
    :func:`freeride.observe.stats.median_interval` of the slowdowns, so its
    coverage holds for pairs whose slowdowns are independent draws of any
    continuous distribution (the harness alternates which run of a pair goes
    first, so a slow drift of the machine favours neither side).

    Raises:
        ValueError: no pairs, a figure that is not positive or not finite, or
            ``confidence`` not in (0, 1).
    """
    if not pairs:
        raise ValueError("pairs must not be empty")
    for a, b in pairs:
        if not (0 < a < float("inf") and 0 < b < float("inf")):
            raise ValueError(f"paired figures must be > 0 and finite, got ({a}, {b})")
    interval = median_interval([b / a - 1 for a, b in pairs], confidence=confidence)
    return Estimate(
        median=interval.median,
        low=interval.low,
        high=interval.high,
        n=interval.n,
        confidence=confidence,
        coverage=interval.coverage,
    )


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
