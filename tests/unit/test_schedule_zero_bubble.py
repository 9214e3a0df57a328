"""Zero-bubble schedules: weight-gradient (W) passes in the notation, the CSV form and the simulator."""

from __future__ import annotations

from collections import deque

import pytest
from test_schedule import FIXTURES, _check_as_early_as_possible

from freeride.backends.schedule import (
    Action,
    Durations,
    Schedule,
    bubble_fraction,
    bubbles,
    interleaved,
    one_f_one_b,
    simulate,
)

# --- zero-bubble: weight-gradient passes --------------------------------------------------------------


def _zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with B split into B and W.

    Stage ``s`` holds back ``s`` of its W passes, so its input gradients (B) reach
    stage ``s-1`` without waiting for weight gradients; the held-back W fill the
    cool-down. Same warm-up, hence the same activation memory, as 1F1B.
    """
    rows: list[tuple[Action, ...]] = []
    for s in range(p):
        warm = min(p - s - 1, m)
        row = [Action(s, "F", mb) for mb in range(warm)]
        held: deque[Action] = deque()
        for i in range(m - warm):
            row += [Action(s, "F", warm + i), Action(s, "B", i)]
            held.append(Action(s, "W", i))
            if len(held) > s:
                row.append(held.popleft())
        for mb in range(m - warm, m):
            row.append(Action(s, "B", mb))
            held.append(Action(s, "W", mb))
            row.append(held.popleft())
        rows.append((*row, *held))
    return Schedule("zb-h1", p, m, 1, tuple(rows))


def _w_after_each_b(schedule: Schedule) -> Schedule:
    """``schedule`` with each B split in two, W right after it (what 1F1B computes)."""
    rows = tuple(
        tuple(x for a in row for x in ((a, Action(a.stage, "W", a.microbatch, a.chunk)) if a.kind == "B" else (a,)))
        for row in schedule.actions
    )
    return Schedule(schedule.name, schedule.num_stages, schedule.num_microbatches, schedule.num_chunks, rows)


def test_weight_pass_notation() -> None:
    assert Action.parse("2W0") == Action(2, "W", 0)
    assert str(Action(1, "W", 3, chunk=1)) == "1W3c1"
    assert Action.parse(" 1W3c1 ") == Action(1, "W", 3, chunk=1)


def test_zb_h1_golden_schedule_and_csv_round_trip() -> None:
    schedule = _zb_h1(4, 8)
    text = (FIXTURES / "zb_h1_p4_m8.csv").read_text()
    assert schedule.to_csv() == text
    assert schedule.has_weight_passes and not one_f_one_b(4, 8).has_weight_passes
    # the last stage sends its first p-1 input gradients before any weight gradient
    assert [str(a) for a in schedule.actions[3][:9]] == ["3F0", "3B0", "3F1", "3B1", "3F2", "3B2", "3F3", "3B3", "3W0"]
    assert Schedule.from_csv(text, name="zb-h1", num_microbatches=8) == schedule
    split = _w_after_each_b(interleaved(2, 4, 2))
    assert Schedule.from_csv(split.to_csv(), name=split.name, num_microbatches=4, num_chunks=2) == split


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("0F0,0B0,0W0,0W0,0F1,0B1\n", "W at most once"),
        ("0F0,0B0,0W2,0F1,0B1\n", "W at most once"),
    ],
)
def test_weight_passes_are_checked(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Schedule.from_csv(text, name="hand", num_microbatches=2)


def test_weight_pass_waits_for_its_backward_and_nobody_waits_for_it() -> None:
    # W before its own B can never run
    schedule = Schedule.from_csv("0F0,0W0,0B0\n", name="hand", num_microbatches=1)
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(schedule, Durations.uniform(1, 1.0, 1.0, weight=1.0))
    # rank 0's B0 needs only rank 1's B0, not its W0: it starts before 1W0 ends
    two = Schedule.from_csv("0F0,0B0,0W0\n1F0,1B0,1W0\n", name="hand", num_microbatches=1)
    timeline = simulate(two, Durations.uniform(2, forward=1.0, backward=2.0, weight=5.0))
    (_, b0, w0), (f1, b1, w1) = timeline.per_rank
    assert (f1.start, b1.start, w1.start) == (1.0, 2.0, 4.0)
    assert b0.start == b1.end == 4.0 and w0.start == b0.end
    assert w1.end == 9.0 and timeline.makespan == w0.end == 11.0


def test_weight_durations_are_required_and_checked() -> None:
    with pytest.raises(ValueError, match="weight"):
        simulate(_zb_h1(2, 2), Durations.uniform(2, forward=1.0, backward=1.0))
    with pytest.raises(ValueError, match="weight"):
        Durations(forward=(1.0, 1.0), backward=(1.0, 1.0), weight=(1.0,))
    with pytest.raises(ValueError, match="weight"):
        Durations.uniform(2, forward=1.0, backward=1.0, weight=-1.0)
    assert Durations.uniform(2, 1.0, 2.0, weight=0.5).cost(1, "W") == 0.5


@pytest.mark.parametrize(("t_f", "t_b", "t_w"), [(1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (2.0, 1.0, 1.5)])
def test_zb_h1_bubbles_are_smaller_than_1f1b(t_f: float, t_b: float, t_w: float) -> None:
    p, m = 4, 8
    durations = Durations.uniform(p, forward=t_f, backward=t_b, weight=t_w)
    zb = simulate(_zb_h1(p, m), durations)
    base = simulate(_w_after_each_b(one_f_one_b(p, m)), durations)
    _check_as_early_as_possible(zb, durations)
    assert zb.makespan < base.makespan
    assert bubble_fraction(zb) < bubble_fraction(base)
    for stage in range(p):
        idle = sum(w.duration for w in bubbles(zb)[stage])
        assert idle < sum(w.duration for w in bubbles(base)[stage])
    # the closed forms of the paper: (p-1)(F+B-W) against (p-1)(F+B), when W <= F, B
    if t_w <= min(t_f, t_b):
        assert zb.makespan == pytest.approx(m * (t_f + t_b + t_w) + (p - 1) * (t_f + t_b - t_w))
    assert base.makespan == pytest.approx(m * (t_f + t_b + t_w) + (p - 1) * (t_f + t_b))
