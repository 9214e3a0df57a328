"""The benchmarks' statistics (tools/bench/_stats.py): paired slowdowns, their order-statistic interval, verdict.

Known inputs only; nothing is timed. The module lives in tools/bench, imported
with that directory on sys.path as the benchmark scripts import it. The
interval itself (and its coverage by simulation) is tested with
``freeride.observe.stats`` in test_median_interval.py.
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


def test_paired_slowdown_is_b_over_a_minus_one(stats: ModuleType) -> None:
    est = stats.paired_slowdown([(100.0, 101.0)] * 6)
    assert est.median == pytest.approx(0.01)
    assert est.low == pytest.approx(0.01)
    assert est.high == pytest.approx(0.01)
    assert est.half_width == pytest.approx(0.0)
    mixed = stats.paired_slowdown([(100.0, 90.0), (100.0, 100.0), (100.0, 120.0)])
    assert mixed.median == pytest.approx(0.0)


def test_eight_pairs_give_the_whole_range_at_99_2_percent(stats: ModuleType) -> None:
    # slowdowns -0.03 .. +0.04 in steps of 0.01; at n = 8 the widest rank that keeps 95 % is k = 1
    # (k = 2 would cover 1 - 2 * 9/256 = 92.97 %), so the interval is min .. max covering 1 - 2/256
    pairs = [(100.0, 100.0 + d) for d in (4, -3, 1, 0, -1, 3, 2, -2)]
    est = stats.paired_slowdown(pairs)
    assert (est.n, est.confidence) == (8, 0.95)
    assert est.median == pytest.approx(0.005)
    assert (est.low, est.high) == (pytest.approx(-0.03), pytest.approx(0.04))
    assert est.coverage == 1 - 2 / 256


def test_twelve_pairs_drop_two_from_each_end(stats: ModuleType) -> None:
    # n = 12: k = 3 covers 1 - 2 * (1 + 12 + 66) / 4096 = 96.14 %; k = 4 would cover 85.40 %
    pairs = [(100.0, 100.0 + d) for d in range(12)]
    est = stats.paired_slowdown(pairs)
    assert (est.low, est.high) == (pytest.approx(0.02), pytest.approx(0.09))
    assert est.coverage == pytest.approx(1 - 2 * 79 / 4096)


def test_too_few_pairs_cover_less_than_asked_and_say_so(stats: ModuleType) -> None:
    est = stats.paired_slowdown([(100.0, 100.0 + d) for d in (1, -2, 3, 0, 2)])
    assert (est.low, est.high) == (pytest.approx(-0.02), pytest.approx(0.03))
    assert est.coverage == 1 - 2 / 32  # 93.75 %, below the 95 % asked
    assert est.coverage < est.confidence
    assert stats.pairs_needed() == 6
    assert stats.pairs_needed(0.99) == 8  # 1 - 2 / 128 = 98.4 % < 99 % <= 1 - 2 / 256


def test_another_confidence_reaches_the_interval(stats: ModuleType) -> None:
    pairs = [(100.0, 100.0 + d) for d in range(20)]
    wide = stats.paired_slowdown(pairs, confidence=0.95)
    narrow = stats.paired_slowdown(pairs, confidence=0.5)
    assert narrow.confidence == 0.5
    assert wide.low <= narrow.low <= narrow.high <= wide.high
    assert narrow.half_width < wide.half_width
    assert narrow.coverage >= 0.5


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
    est = stats.Estimate(median=median, low=low, high=high, n=8, coverage=0.99)
    assert stats.verdict(est) == expected
    predicate = "straddles" if expected == "straddles" else f"lies {expected}"
    assert stats.verdict_text(est) == f"{predicate} the 0.5 % goal"


def test_verdict_takes_another_goal(stats: ModuleType) -> None:
    est = stats.Estimate(median=0.01, low=0.008, high=0.012, n=8, coverage=0.99)
    assert stats.verdict(est, goal=0.02) == "below"
    assert stats.verdict_text(est, goal=0.02) == "lies below the 2.0 % goal"


def test_a_a_floor_of_identical_runs_is_zero(stats: ModuleType) -> None:
    floor = stats.paired_slowdown([(250.0, 250.0), (260.0, 260.0), (240.0, 240.0)])
    assert (floor.median, floor.low, floor.high) == (0.0, 0.0, 0.0)
    assert floor.coverage == 1 - 2 / 8


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.paired_slowdown([]), "pairs must not be empty"),
        (lambda s: s.paired_slowdown([(0.0, 1.0)]), "must be > 0"),
        (lambda s: s.paired_slowdown([(1.0, float("inf"))]), "finite"),
        (lambda s: s.paired_slowdown([(1.0, float("nan"))]), "finite"),
        (lambda s: s.paired_slowdown([(1.0, 1.0)], confidence=1.0), "confidence"),
        (lambda s: s.pairs_needed(0.0), "confidence"),
        (lambda s: s.Estimate(median=0.0, low=0.1, high=0.2, n=1, coverage=0.5), "must contain the median"),
        (lambda s: s.Estimate(median=0.0, low=0.0, high=0.0, n=1, coverage=1.5), "coverage"),
    ],
)
def test_bad_input_is_a_value_error(stats: ModuleType, call: Callable[[ModuleType], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call(stats)


def test_reports_say_what_a_short_interval_covers(stats: ModuleType) -> None:
    # the reports (tools/bench/_bench_report.py) never print "95 %" over an interval that covers less
    report = importlib.import_module("_bench_report")
    four = stats.paired_slowdown([(100.0, 100.0 + d) for d in (1, -2, 3, 0)])
    assert report._interval(four) == "-2.00 % .. +3.00 % (95 % interval needs 6 pairs: min .. max covers 87.5 %)"
    five = stats.paired_slowdown([(100.0, 100.0 + d) for d in (1, -2, 3, 0, 2)])
    assert report._interval(five).endswith("(95 % interval needs 6 pairs: min .. max covers 93.8 %)")
    six = stats.paired_slowdown([(100.0, 100.0 + d) for d in (1, -2, 3, 0, 2, 1)])
    assert report._interval(six) == "-2.00 % .. +3.00 %"
