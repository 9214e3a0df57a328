"""Small statistics: running latencies kept by the manager, and a distribution-free interval of a median."""

from __future__ import annotations

import functools
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LatencyRecorder", "MedianInterval", "median_interval", "order_statistic_ranks", "pairs_needed", "quantile"]


def quantile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank quantile of an already sorted list (0 if empty)."""
    if not sorted_values:
        return 0
    rank = max(0, min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1))))
    return sorted_values[rank]


class LatencyRecorder:
    """Keeps the most recent ``capacity`` latencies (ns) and summarises them.

    The summary sorts the values kept, on the manager's loop: the window is
    kept small enough for that to take a few ms (20k values), and a summary is
    reused until a new value arrives.
    """

    def __init__(self, capacity: int = 20_000) -> None:
        self._values: deque[int] = deque(maxlen=capacity)
        self.count = 0
        self._summary: tuple[int, tuple[int, int, int]] = (0, (0, 0, 0))

    def record(self, value_ns: int) -> None:
        self._values.append(value_ns)
        self.count += 1

    def values(self) -> list[int]:
        return list(self._values)

    def summary(self) -> tuple[int, int, int]:
        """``(p50, p99, max)`` over the values kept."""
        seen, cached = self._summary
        if seen == self.count:
            return cached
        values = sorted(self._values)
        summary = quantile(values, 0.50), quantile(values, 0.99), (values[-1] if values else 0)
        self._summary = (self.count, summary)
        return summary


@dataclass(frozen=True, kw_only=True, slots=True)
class MedianInterval:
    """The sample median of some values and a distribution-free interval of the population median."""

    median: float
    low: float
    """Lower end of the interval: an order statistic of the values."""
    high: float
    """Upper end of the interval: an order statistic of the values."""
    n: int
    """Values behind it."""
    coverage: float
    """The interval's guaranteed coverage: at least the confidence asked for where n allows, else the most n allows
    (the whole range)."""

    def __post_init__(self) -> None:
        if not self.low <= self.median <= self.high:
            raise ValueError(f"interval [{self.low}, {self.high}] must contain the median {self.median}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.coverage <= 1:
            raise ValueError(f"coverage must be in [0, 1], got {self.coverage}")

    @property
    def half_width(self) -> float:
        """Half the interval's width: how finely these values resolve a difference."""
        return (self.high - self.low) / 2


@functools.lru_cache(maxsize=256)
def order_statistic_ranks(n: int, confidence: float = 0.95) -> tuple[int, int, float]:
    """0-based indices (lo, hi) into the sorted values, and the exact coverage 1 - 2*P(Binomial(n, 1/2) <= lo).

    The interval is ``[x_(k), x_(n+1-k)]`` (1-based order statistics) with the
    largest ``k`` whose coverage ``1 - 2 * P(Binomial(n, 1/2) <= k - 1)`` is
    still at least ``confidence``, so ``lo = k - 1`` and ``hi = n - k``. Where
    even the whole range falls short (``n <= 5`` at 95 %) it is ``(0, n - 1)``
    with its own coverage ``1 - 2 * 0.5**n``, below ``confidence``.

    The binomial sums are exact integers (no approximation, no scipy): a few
    ms up to ``n`` of about 5000, about 0.1 s at 20 000; results are cached.

    Args:
        n: How many values.
        confidence: The coverage asked for, in (0, 1).

    Returns:
        ``(lo, hi, coverage)``.

    Raises:
        ValueError: ``n`` < 1, or ``confidence`` not in (0, 1).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    total = 1 << n  # 2**n (which mypy types as Any)
    # coverage(k) = (total - 2 * cdf) / total, cdf = sum of comb(n, i) for i < k, falls as k grows. Each term
    # comes exactly from the one before, comb(n, i + 1) = comb(n, i) * (n - i) / (i + 1) in integers, instead
    # of a fresh math.comb per term (quadratic in n: D43).
    term = 1  # comb(n, 0)
    cdf = term
    best, best_coverage = 1, (total - 2 * cdf) / total
    for k in range(2, (n + 1) // 2 + 1):
        term = term * (n - k + 2) // (k - 1)
        cdf += term
        coverage = (total - 2 * cdf) / total
        if coverage < confidence:
            break
        best, best_coverage = k, coverage
    return best - 1, n - best, best_coverage


def pairs_needed(confidence: float = 0.95) -> int:
    """The fewest values whose interval of the median reaches ``confidence`` (6 at 95 %).

    Raises:
        ValueError: ``confidence`` not in (0, 1).
    """
    n = 1
    while order_statistic_ranks(n, confidence)[2] < confidence:
        n += 1
    return n


def median_interval(values: Sequence[float], *, confidence: float = 0.95) -> MedianInterval:
    """The sample median of ``values`` and an order-statistic (sign-test) interval of the population median.

    Why it holds: for independent values with a continuous distribution, the
    count of values below the population median is Binomial(n, 1/2), so
    ``[x_(k), x_(n+1-k)]`` misses it with probability ``2 * P(Binomial(n, 1/2)
    <= k - 1)`` whatever the distribution (with ties the closed interval only
    covers more). In a randomized paired design (which arm of a pair gets the
    treatment is a fair coin) the sign of each pair's difference is a fair coin
    under "no effect" whatever the dependence between pairs, and inverting that
    sign test gives the same interval for a constant effect. See
    :func:`order_statistic_ranks` for ``k``; where ``n`` is too small for
    ``confidence`` the interval is the whole range and :attr:`MedianInterval.coverage`
    says how much less it covers.

    Args:
        values: The sample; at least one finite value.
        confidence: The coverage asked for, in (0, 1).

    Returns:
        The median, the interval and its guaranteed coverage.

    Raises:
        ValueError: ``values`` empty or holding a value that is not finite, or
            ``confidence`` not in (0, 1).
    """
    if not values:
        raise ValueError("values must not be empty")
    data = [float(v) for v in values]
    if not all(math.isfinite(v) for v in data):
        raise ValueError(f"values must all be finite, got {next(v for v in data if not math.isfinite(v))}")
    data.sort()
    lo, hi, coverage = order_statistic_ranks(len(data), confidence)
    return MedianInterval(median=statistics.median(data), low=data[lo], high=data[hi], n=len(data), coverage=coverage)
