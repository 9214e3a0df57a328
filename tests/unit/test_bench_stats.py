"""The benchmarks' statistics (tools/bench/_stats.py): bootstrap interval of a median, paired slowdowns, verdict.

Known inputs only; nothing is timed. The module lives in tools/bench, imported
with that directory on sys.path as the benchmark scripts import it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "tools" / "bench"


@pytest.fixture
def stats(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module("_stats")


def test_constant_values_give_a_point_interval(stats: ModuleType) -> None:
    est = stats.bootstrap_median_ci([2.5] * 7)
    assert (est.median, est.low, est.high, est.n) == (2.5, 2.5, 2.5, 7)
    assert est.half_width == 0


def test_two_values_span_both(stats: ModuleType) -> None:
    # resampled medians of [0, 1]: 0 (1/4), 0.5 (1/2), 1 (1/4); the 2.5 % and 97.5 % points are the ends
    est = stats.bootstrap_median_ci([0.0, 1.0])
    assert (est.median, est.low, est.high) == (0.5, 0.0, 1.0)


def test_interval_contains_the_median_and_lies_within_the_values(stats: ModuleType) -> None:
    values = [0.01, -0.02, 0.03, 0.00, 0.05, -0.01, 0.02, 0.04]
    est = stats.bootstrap_median_ci(values)
    assert est.median == pytest.approx(0.015)
    assert min(values) <= est.low <= est.median <= est.high <= max(values)
    assert est.low < est.median < est.high


def test_bootstrap_is_deterministic_per_seed(stats: ModuleType) -> None:
    values = [0.3, -0.1, 0.7, 0.2, 0.05, 0.4, -0.2, 0.9, 0.15]
    first = stats.bootstrap_median_ci(values, seed=3)
    assert stats.bootstrap_median_ci(values, seed=3) == first
    others = {(e.low, e.high) for e in (stats.bootstrap_median_ci(values, seed=s, resamples=50) for s in range(20))}
    assert len(others) > 1, "the seed is not used"


def test_narrower_confidence_gives_a_narrower_interval(stats: ModuleType) -> None:
    values = [float(v) for v in range(20)]
    wide = stats.bootstrap_median_ci(values, confidence=0.95)
    narrow = stats.bootstrap_median_ci(values, confidence=0.5)
    assert wide.low <= narrow.low <= narrow.high <= wide.high
    assert narrow.half_width < wide.half_width


def test_paired_slowdown_is_b_over_a_minus_one(stats: ModuleType) -> None:
    est = stats.paired_slowdown([(100.0, 101.0)] * 5)
    assert est.median == pytest.approx(0.01)
    assert est.low == pytest.approx(0.01)
    assert est.high == pytest.approx(0.01)
    mixed = stats.paired_slowdown([(100.0, 90.0), (100.0, 100.0), (100.0, 120.0)])
    assert mixed.median == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("low", "median", "high", "expected"),
    [
        (-0.02, -0.01, 0.004, "below"),
        (-0.02, 0.0, 0.005, "below"),  # ending at the goal meets "at most 0.5 %"
        (-0.01, 0.002, 0.02, "straddles"),
        (0.005, 0.01, 0.02, "straddles"),  # starting at the goal does not clear it
        (0.006, 0.01, 0.02, "above"),
    ],
)
def test_verdict_against_the_goal(stats: ModuleType, low: float, median: float, high: float, expected: str) -> None:
    est = stats.Estimate(median=median, low=low, high=high, n=8)
    assert stats.verdict(est) == expected
    predicate = "straddles" if expected == "straddles" else f"lies {expected}"
    assert stats.verdict_text(est) == f"{predicate} the 0.5 % goal"


def test_verdict_takes_another_goal(stats: ModuleType) -> None:
    est = stats.Estimate(median=0.01, low=0.008, high=0.012, n=8)
    assert stats.verdict(est, goal=0.02) == "below"
    assert stats.verdict_text(est, goal=0.02) == "lies below the 2.0 % goal"


def test_a_a_floor_of_identical_runs_is_zero(stats: ModuleType) -> None:
    floor = stats.paired_slowdown([(250.0, 250.0), (260.0, 260.0), (240.0, 240.0)])
    assert (floor.median, floor.low, floor.high) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.bootstrap_median_ci([]), "must not be empty"),
        (lambda s: s.bootstrap_median_ci([1.0], confidence=1.0), "confidence"),
        (lambda s: s.bootstrap_median_ci([1.0], resamples=0), "resamples"),
        (lambda s: s.paired_slowdown([]), "must not be empty"),
        (lambda s: s.paired_slowdown([(0.0, 1.0)]), "must be > 0"),
        (lambda s: s.Estimate(median=0.0, low=0.1, high=0.2, n=1), "must contain the median"),
    ],
)
def test_bad_input_is_a_value_error(stats: ModuleType, call: Callable[[ModuleType], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(stats)
