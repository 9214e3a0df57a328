"""``tools/gpu/gate_bench.py``'s arithmetic: start lag, trainer delay, bubble use and overrun from device times.

The benchmark itself needs a GPU (stream memory operations); its figures come
from intervals, which are checked here on hand-made ones.
"""

from __future__ import annotations

from typing import Any

import pytest
from _files import load

US = 1_000


def _bench() -> Any:
    return load("tools/gpu/gate_bench.py", "gate_bench")


gate_bench = _bench()


def test_lag_use_overrun_and_delay_from_intervals() -> None:
    # (open, receive end, first kernel end, side) in ns: a bubble without side work, then two with
    intervals = [
        (0, 1000 * US, 1010 * US, False),
        (2000 * US, 3000 * US, 3030 * US, True),
        (4000 * US, 5000 * US, 5012 * US, True),
    ]
    pieces = [
        (2005 * US, 2505 * US),  # 5 us after the open
        (2505 * US, 3005 * US),  # runs 5 us past the bubble's end
        (4020 * US, 4520 * US),  # 20 us after the open
        (6000 * US, 6100 * US),  # drained after the last bubble: not counted
    ]
    r = gate_bench._summarise(intervals, pieces, 0)
    assert r["bubbles_gated"] == 2
    assert r["start_lag_us"]["p50"] in (5.0, 20.0) and r["start_lag_us"]["n"] == 2
    assert r["start_lag_us"]["p99"] == 20.0
    assert r["bubble_use"] == pytest.approx((500 + 495 + 500) / 2000)
    assert r["overrun_of_bubble_time"] == pytest.approx(5 / 2000)
    fk = r["first_kernel_us"]
    assert fk["alone_p50"] == 10.0 and fk["side_p99"] == 30.0
    assert fk["delay_p99"] == 20.0


def test_a_bubble_no_piece_reached_has_no_lag() -> None:
    intervals = [(0, 100 * US, 110 * US, True)]
    r = gate_bench._summarise(intervals, [(200 * US, 250 * US)], 0)
    assert r["start_lag_us"]["n"] == 0 and r["bubble_use"] == 0.0


def test_blocks_alternate_with_and_without_side_work() -> None:
    class Ns:
        bubbles = 50

    plan = gate_bench._plan(Ns())
    assert len(plan) == 100 and sum(plan) == 50
    assert plan[:20] == [False] * 20 and plan[20:40] == [True] * 20
