"""Schedules as values, the dry-run simulator and bubble finding (freeride.backends.schedule)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from freeride.backends.schedule import (
    SCHEDULE_NAMES,
    Action,
    BubbleWindow,
    Durations,
    Kind,
    Schedule,
    Timeline,
    bubble_fraction,
    bubbles,
    bubbles_to_text,
    build_schedule,
    gpipe,
    interleaved,
    one_f_one_b,
    simulate,
)

FIXTURES = Path(__file__).parent / "fixtures"


def _all_schedules() -> Iterator[Schedule]:
    for p, m in itertools.product(range(1, 5), range(1, 7)):
        yield gpipe(p, m)
        yield one_f_one_b(p, m)
    for p, k, v in itertools.product(range(1, 4), range(1, 3), range(2, 4)):
        yield interleaved(p, k * p, v)


# --- notation and CSV ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "action"),
    [
        ("2F0", Action(2, "F", 0)),
        ("0B3", Action(0, "B", 3)),
        ("12F34", Action(12, "F", 34)),
        ("1B5c1", Action(1, "B", 5, chunk=1)),
        ("3F0c12", Action(3, "F", 0, chunk=12)),
    ],
)
def test_action_notation_round_trip(text: str, action: Action) -> None:
    assert Action.parse(text) == action
    assert str(action) == text
    assert Action.parse(str(action)) == action


def test_chunk_zero_is_not_written() -> None:
    assert str(Action(1, "F", 2, chunk=0)) == "1F2"
    assert Action.parse(" 1F2c0 ") == Action(1, "F", 2)


@pytest.mark.parametrize("text", ["", "F0", "2F", "2X0", "2f0", "2F0c", "-1F0", "2F0c1x", "2 F0"])
def test_action_parse_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="2F0 notation"):
        Action.parse(text)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"stage": -1, "kind": "F", "microbatch": 0}, "stage"),
        ({"stage": 0, "kind": "F", "microbatch": -2}, "microbatch"),
        ({"stage": 0, "kind": "F", "microbatch": 0, "chunk": -1}, "chunk"),
        ({"stage": 0, "kind": "X", "microbatch": 0}, "kind"),
    ],
)
def test_action_validates_fields(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Action(**kwargs)


def test_csv_round_trip() -> None:
    for schedule in _all_schedules():
        text = schedule.to_csv()
        assert len(text.splitlines()) == schedule.num_stages
        back = Schedule.from_csv(
            text,
            name=schedule.name,
            num_microbatches=schedule.num_microbatches,
            num_chunks=schedule.num_chunks,
        )
        assert back == schedule


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("0F0,0B0,0F1,0B1\n0F0,0B0,0F1,0B1\n", "rank 1 lists actions of other ranks"),
        ("0F0,0B0,0F1\n", "exactly once"),
        ("0F0,0B0,0F0,0B1\n", "exactly once"),
        ("0F0,0B0,0F1,0B1,0F2,0B2\n", "exactly once"),
        ("0F0,0Q0\n", "2F0 notation"),
    ],
)
def test_from_csv_rejects_incomplete_schedules(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Schedule.from_csv(text, name="hand", num_microbatches=2)


def test_schedule_validates_sizes() -> None:
    with pytest.raises(ValueError, match="num_microbatches"):
        one_f_one_b(2, 0)
    with pytest.raises(ValueError, match="num_stages"):
        gpipe(0, 2)
    with pytest.raises(ValueError, match="num_chunks"):
        interleaved(2, 4, 0)
    with pytest.raises(ValueError, match="multiple of num_stages"):
        interleaved(4, 6, 2)
    with pytest.raises(ValueError, match="actions: 1 ranks"):
        Schedule("x", 2, 1, 1, ((Action(0, "F", 0), Action(0, "B", 0)),))


def test_build_schedule_by_name() -> None:
    assert set(SCHEDULE_NAMES) == {"gpipe", "1f1b", "interleaved"}
    assert build_schedule("gpipe", 3, 5) == gpipe(3, 5)
    assert build_schedule("1f1b", 3, 5) == one_f_one_b(3, 5)
    assert build_schedule("interleaved", 2, 4, 3) == interleaved(2, 4, 3)
    with pytest.raises(ValueError, match="name"):
        build_schedule("zb-h1", 2, 4)
    with pytest.raises(ValueError, match="num_chunks"):
        build_schedule("1f1b", 2, 4, 2)


# --- golden fixtures ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("filename", "schedule"),
    [
        ("1f1b_p4_m4.csv", one_f_one_b(4, 4)),
        ("gpipe_p4_m4.csv", gpipe(4, 4)),
        ("interleaved_p2_m4_v2.csv", interleaved(2, 4, 2)),
    ],
)
def test_golden_schedules(filename: str, schedule: Schedule) -> None:
    text = (FIXTURES / filename).read_text()
    assert schedule.to_csv() == text
    loaded = Schedule.from_csv(
        text, name=schedule.name, num_microbatches=schedule.num_microbatches, num_chunks=schedule.num_chunks
    )
    assert loaded == schedule


def test_golden_bubbles_1f1b_p4_m4() -> None:
    timeline = simulate(one_f_one_b(4, 4), Durations.uniform(4, forward=1.0, backward=2.0))
    assert bubbles_to_text(bubbles(timeline)) == (FIXTURES / "bubbles_1f1b_p4_m4_f1_b2.txt").read_text()


# --- closed forms ------------------------------------------------------------------------------------


def _expected_1f1b_bubbles(p: int, m: int, s: int, t_f: float, t_b: float) -> list[tuple[float, Action | None]]:
    """(duration, action after the gap) of stage s in 1F1B with m >= p and free communication.

    head s*t_f before F0; fill gap (p-1-s)*t_b before B0; one t_f gap before each of the
    last p-1-s backwards; tail s*t_b.
    """
    expected: list[tuple[float, Action | None]] = [(s * t_f, Action(s, "F", 0))]
    expected.append(((p - 1 - s) * t_b, Action(s, "B", 0)))
    expected += [(t_f, Action(s, "B", mb)) for mb in range(m - (p - 1 - s), m)]
    expected.append((s * t_b, None))
    return [(d, a) for d, a in expected if d > 0]


@pytest.mark.parametrize(("t_f", "t_b"), [(1.0, 2.0), (3.0, 1.0), (0.25, 0.5)])
def test_1f1b_bubbles_match_closed_form(t_f: float, t_b: float) -> None:
    for p in range(1, 7):
        for m in range(p, 10):
            timeline = simulate(one_f_one_b(p, m), Durations.uniform(p, forward=t_f, backward=t_b))
            assert timeline.makespan == pytest.approx((m + p - 1) * (t_f + t_b))
            for s, windows in enumerate(bubbles(timeline)):
                got = [(w.duration, w.before) for w in windows]
                expected = _expected_1f1b_bubbles(p, m, s, t_f, t_b)
                assert [a for _, a in got] == [a for _, a in expected], (p, m, s)
                assert [d for d, _ in got] == pytest.approx([d for d, _ in expected]), (p, m, s)
                assert [w.index for w in windows] == list(range(len(windows)))
                if windows:
                    assert windows[0].start == 0.0 or s == 0
                    assert windows[-1].end == pytest.approx(timeline.makespan) or s == 0


@pytest.mark.parametrize("builder", [gpipe, one_f_one_b])
def test_bubble_fraction_gpipe_and_1f1b(builder: Any) -> None:
    for p, m in itertools.product(range(1, 7), range(1, 10)):
        timeline = simulate(builder(p, m), Durations.uniform(p, forward=1.0, backward=2.0))
        theory = (p - 1) / (m + p - 1)
        assert abs(bubble_fraction(timeline) - theory) <= 1e-9, (p, m)
        for s in range(p):
            assert abs(bubble_fraction(timeline, s) - theory) <= 1e-9, (p, m, s)


def test_bubble_fraction_interleaved() -> None:
    for p, k, v in itertools.product(range(1, 6), range(1, 4), range(2, 5)):
        m = k * p
        timeline = simulate(interleaved(p, m, v), Durations.uniform(p, forward=1.0, backward=2.0))
        assert abs(bubble_fraction(timeline) - (p - 1) / (v * m + p - 1)) <= 1e-9, (p, m, v)


def test_bubble_fraction_is_mean_of_stages_and_checks_stage() -> None:
    durations = Durations(forward=(1.0, 2.0, 1.0), backward=(2.0, 3.0, 1.0))
    timeline = simulate(one_f_one_b(3, 5), durations)
    per_stage = [bubble_fraction(timeline, s) for s in range(3)]
    assert len(set(per_stage)) > 1
    assert bubble_fraction(timeline) == pytest.approx(sum(per_stage) / 3)
    idle = [sum(w.duration for w in row) for row in bubbles(timeline)]
    assert per_stage == pytest.approx([i / timeline.makespan for i in idle])
    with pytest.raises(ValueError, match="stage"):
        bubble_fraction(timeline, 3)


def test_min_duration_drops_short_windows_and_keeps_indices_dense() -> None:
    timeline = simulate(one_f_one_b(4, 6), Durations.uniform(4, forward=1.0, backward=2.0))
    everything = bubbles(timeline)
    kept = bubbles(timeline, min_duration=1.0)  # cool-down gaps and stage 1's head last exactly t_f
    for all_row, kept_row in zip(everything, kept, strict=True):
        assert [w.index for w in kept_row] == list(range(len(kept_row)))
        assert [(w.start, w.duration) for w in kept_row] == [(w.start, w.duration) for w in all_row if w.duration > 1.0]
        assert all(w.end == w.start + w.duration for w in kept_row)
    assert len(kept[0]) == 1 and kept[0][0].before == Action(0, "B", 0)


# --- simulator ---------------------------------------------------------------------------------------


def _check_as_early_as_possible(timeline: Timeline, durations: Durations) -> None:
    schedule = timeline.schedule
    p, nv = schedule.num_stages, schedule.num_stages * schedule.num_chunks
    ends = {
        (t.action.kind, t.action.microbatch, t.action.chunk * p + t.action.stage): (t.end, t.action.stage)
        for row in timeline.per_rank
        for t in row
    }
    for rank, row in enumerate(timeline.per_rank):
        assert [t.action for t in row] == list(schedule.actions[rank])
        previous_end = 0.0
        for t in row:
            a = t.action
            u = a.chunk * p + a.stage
            cost = {"F": durations.forward, "B": durations.backward, "W": durations.weight}[a.kind][rank]
            assert t.end == pytest.approx(t.start + cost)
            dep: tuple[Kind, int, int] | None
            if a.kind == "W":
                dep = ("B", a.microbatch, u)
            elif a.kind == "F":
                dep = ("F", a.microbatch, u - 1) if u > 0 else None
            else:
                dep = ("F", a.microbatch, u) if u == nv - 1 else ("B", a.microbatch, u + 1)
            ready = 0.0
            if dep is not None:
                dep_end, dep_rank = ends[dep]
                ready = dep_end + (durations.comm if dep_rank != rank else 0.0)
            assert t.start == pytest.approx(max(previous_end, ready))
            previous_end = t.end
    assert timeline.makespan == max(row[-1].end for row in timeline.per_rank)


def test_simulate_respects_dependencies_with_random_durations() -> None:
    rng = random.Random(7)
    for schedule in _all_schedules():
        p = schedule.num_stages
        durations = Durations(
            forward=tuple(rng.uniform(0.1, 2.0) for _ in range(p)),
            backward=tuple(rng.uniform(0.1, 4.0) for _ in range(p)),
            comm=rng.choice([0.0, 0.05, 0.3]),
        )
        timeline = simulate(schedule, durations)
        _check_as_early_as_possible(timeline, durations)
        for row in bubbles(timeline):
            assert all(w.duration > 0 for w in row)


@pytest.mark.parametrize("builder", [gpipe, one_f_one_b])
def test_comm_adds_latency_per_cross_rank_hop(builder: Any) -> None:
    for p in range(1, 6):
        timeline = simulate(builder(p, 1), Durations.uniform(p, forward=1.0, backward=2.0, comm=0.25))
        assert timeline.makespan == pytest.approx(p * 3.0 + 2 * (p - 1) * 0.25)


def test_comm_is_not_charged_between_chunks_on_one_rank() -> None:
    timeline = simulate(interleaved(1, 3, 3), Durations.uniform(1, forward=1.0, backward=2.0, comm=5.0))
    assert timeline.makespan == pytest.approx(3 * 3 * 3.0)


@pytest.mark.parametrize(
    ("text", "m"),
    [
        ("0F0,0B0\n1B0,1F0\n", 1),  # the last stage's backward before its own forward
        ("0B0,0F0\n1F0,1B0\n", 1),  # the first stage's backward before its forward
        ("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n", 2),  # rank 1 waits for F1, rank 0 for B0
        # rank 0 waits for B0 before F1, which rank 1 needs before it runs B0
        ("0F0,0B0,0F1,0F2,0B1,0B2\n1F0,1F1,1B0,1F2,1B1,1B2\n2F0,2B0,2F1,2B1,2F2,2B2\n", 3),
    ],
)
def test_simulate_rejects_deadlocking_schedule(text: str, m: int) -> None:
    schedule = Schedule.from_csv(text, name="hand", num_microbatches=m)
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(schedule, Durations.uniform(schedule.num_stages, forward=1.0, backward=1.0))


def test_simulate_checks_durations() -> None:
    with pytest.raises(ValueError, match="ranks"):
        simulate(one_f_one_b(3, 3), Durations.uniform(2, forward=1.0, backward=1.0))
    with pytest.raises(ValueError, match="forward"):
        Durations(forward=(1.0, -1.0), backward=(1.0, 1.0))
    with pytest.raises(ValueError, match="same"):
        Durations(forward=(1.0,), backward=(1.0, 1.0))
    with pytest.raises(ValueError, match="comm"):
        Durations.uniform(2, forward=1.0, backward=1.0, comm=float("nan"))


def test_bubble_window_end() -> None:
    window = BubbleWindow(stage=1, index=0, start=0.5, duration=0.25, before=None)
    assert window.end == 0.75
