"""The order-statistic (sign-test) interval of a median (freeride.observe.stats): known ranks, errors, coverage.

The ranks are checked against binomial sums worked out here; the coverage is
checked by simulation (seeded, so the counts are the same on every run) for
a normal, a skewed (lognormal) and a heavy-tailed (Cauchy) distribution, and
for the percentile bootstrap this interval replaced in the benchmarks, which
at seven values covers well short of the 95 % it claimed.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence

import pytest

from freeride.observe import stats
from freeride.observe.stats import MedianInterval, median_interval, order_statistic_ranks


def _binomial_cdf(n: int, k: int) -> float:
    """P(Binomial(n, 1/2) <= k), summed term by term (the reference the module's running sum is checked against)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / (1 << n)


def test_public_names() -> None:
    assert {"MedianInterval", "median_interval", "order_statistic_ranks"} <= set(stats.__all__)


@pytest.mark.parametrize(
    ("n", "lo", "hi", "coverage"),
    [
        # n = 6..8: only the whole range reaches 95 % (k = 2 would cover 1 - 2 * 7/64, 1 - 2 * 8/128, 1 - 2 * 9/256)
        (6, 0, 5, 1 - 2 / 64),
        (7, 0, 6, 1 - 2 / 128),
        (8, 0, 7, 1 - 2 / 256),
        # n = 20: P(Bin <= 5) = (1 + 20 + 190 + 1140 + 4845 + 15504) / 2**20 = 21700 / 1048576
        (20, 5, 14, 1 - 2 * 21700 / 2**20),
        # n = 100: the textbook x_(40) .. x_(61), P(Bin <= 39) = 0.0176001
        (100, 39, 60, 0.9647998),
    ],
)
def test_ranks_at_95_percent(n: int, lo: int, hi: int, coverage: float) -> None:
    got = order_statistic_ranks(n)
    assert got[:2] == (lo, hi)
    assert got[2] == pytest.approx(coverage, abs=1e-7)
    assert got[2] == pytest.approx(1 - 2 * _binomial_cdf(n, lo), rel=1e-12)
    # the largest such rank: one more from each end falls below 95 %
    assert 1 - 2 * _binomial_cdf(n, lo + 1) < 0.95


def test_ranks_at_another_confidence() -> None:
    # n = 10: cumulative counts 1, 11, 56, 176, 386 of 1024; at 50 % k = 4 (1 - 2 * 176/1024), k = 5 gives 24.6 %
    assert order_statistic_ranks(10, 0.5) == (3, 6, 1 - 2 * 176 / 1024)
    assert order_statistic_ranks(10, 0.99) == (0, 9, 1 - 2 / 1024)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_too_few_values_give_the_whole_range_and_its_true_coverage(n: int) -> None:
    assert order_statistic_ranks(n) == (0, n - 1, 1 - 2 * 0.5**n)
    values = [float(v) for v in range(n, 0, -1)]
    interval = median_interval(values)
    assert (interval.low, interval.high, interval.n) == (1.0, float(n), n)
    assert interval.coverage == 1 - 2 * 0.5**n
    assert interval.coverage < 0.95


def test_median_interval_of_known_values() -> None:
    interval = median_interval([5, 1, 4, 2, 3, 9, 7, 8, 6])  # n = 9: k = 2 covers 1 - 2 * 10/512
    assert interval == MedianInterval(median=5.0, low=2.0, high=8.0, n=9, coverage=1 - 2 * 10 / 512)
    assert interval.half_width == 3.0
    even = median_interval([6.0, 1.0, 3.0, 2.0, 5.0, 4.0])
    assert (even.median, even.low, even.high) == (3.5, 1.0, 6.0)
    tied = median_interval([0.25] * 7)
    assert (tied.median, tied.low, tied.high, tied.half_width) == (0.25, 0.25, 0.25, 0.0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: median_interval([]), "values must not be empty"),
        (lambda: median_interval([1.0, float("nan")]), "values must all be finite"),
        (lambda: median_interval([1.0, float("-inf"), 2.0]), "values must all be finite"),
        (lambda: median_interval([1.0], confidence=0.0), "confidence"),
        (lambda: median_interval([1.0], confidence=1.0), "confidence"),
        (lambda: median_interval([1.0], confidence=float("nan")), "confidence"),
        (lambda: order_statistic_ranks(0), "n must be >= 1"),
        (lambda: order_statistic_ranks(5, 1.5), "confidence"),
        (lambda: MedianInterval(median=0.0, low=0.1, high=0.2, n=1, coverage=0.5), "must contain the median"),
        (lambda: MedianInterval(median=0.0, low=0.0, high=0.0, n=0, coverage=0.5), "n must be >= 1"),
        (lambda: MedianInterval(median=0.0, low=0.0, high=0.0, n=1, coverage=-0.1), "coverage"),
    ],
)
def test_bad_input_is_a_value_error(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


# -- coverage by simulation ---------------------------------------------------------

SAMPLES = 2000
"""Samples per (n, distribution): 3 standard errors at 96-99 % coverage are 1.0-0.6 points."""
BOOTSTRAP_SAMPLES = 400
BOOTSTRAP_RESAMPLES = 500

Draw = Callable[[random.Random], float]
DISTRIBUTIONS: dict[str, tuple[Draw, float]] = {
    "normal": (lambda rng: rng.gauss(0.0, 1.0), 0.0),
    "lognormal": (lambda rng: rng.lognormvariate(0.0, 1.0), 1.0),
    "cauchy": (lambda rng: math.tan(math.pi * (rng.random() - 0.5)), 0.0),
}
"""Name: (one draw, the population median)."""


def _three_se(p: float, samples: int) -> float:
    return 3 * math.sqrt(p * (1 - p) / samples)


def _percentile_bootstrap(values: Sequence[float], rng: random.Random) -> tuple[float, float]:
    """The benchmarks' old interval: the 2.5 % and 97.5 % points (interpolated) of resampled medians."""
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(BOOTSTRAP_RESAMPLES))

    def point(q: float) -> float:
        pos = q * (len(medians) - 1)
        i = int(pos)
        return medians[i] + (medians[min(i + 1, len(medians) - 1)] - medians[i]) * (pos - i)

    return point(0.025), point(0.975)


def test_coverage_by_simulation_and_the_bootstrap_it_replaced() -> None:
    rng = random.Random(20240611)
    failures: dict[tuple[int, str], str] = {}
    for n in (6, 7, 8, 12, 30):
        guaranteed = order_statistic_ranks(n)[2]
        for name, (draw, median) in DISTRIBUTIONS.items():
            hits = 0
            for _ in range(SAMPLES):
                interval = median_interval([draw(rng) for _ in range(n)])
                hits += interval.low <= median <= interval.high
            if hits / SAMPLES < guaranteed - _three_se(guaranteed, SAMPLES):
                failures[n, name] = f"{hits / SAMPLES:.1%} < {guaranteed:.1%} - 3 SE"
    assert not failures, f"covered less than guaranteed: {failures}"

    # The percentile bootstrap at n = 7 is about [x_(2), x_(6)], which covers 1 - 2 * 8/128 = 87.5 %, not 95 %.
    draw, median = DISTRIBUTIONS["normal"]
    hits = 0
    for _ in range(BOOTSTRAP_SAMPLES):
        low, high = _percentile_bootstrap([draw(rng) for _ in range(7)], rng)
        hits += low <= median <= high
    share = hits / BOOTSTRAP_SAMPLES
    assert share + _three_se(share, BOOTSTRAP_SAMPLES) < 0.95, f"bootstrap covered {share:.1%} at n = 7"


def test_randomized_pairs_cover_whatever_the_dependence_between_pairs() -> None:
    # No effect, arms assigned by a fair coin: each pair's difference is +-|noise| with a fair sign, and the
    # noise drifts as a random walk (strongly dependent pairs). The count of negative differences is still
    # Binomial(n, 1/2), so the interval covers the zero effect as often as guaranteed.
    rng = random.Random(7)
    n = 8
    guaranteed = order_statistic_ranks(n)[2]
    hits = 0
    for _ in range(SAMPLES):
        level, diffs = 1.0, []
        for _ in range(n):
            level = abs(level + rng.gauss(0.0, 0.5)) + 1e-9
            diffs.append(level if rng.random() < 0.5 else -level)
        interval = median_interval(diffs)
        hits += interval.low <= 0.0 <= interval.high
    assert hits / SAMPLES >= guaranteed - _three_se(guaranteed, SAMPLES)
