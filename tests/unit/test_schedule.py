"""Schedules as values, the dry-run simulator and bubble finding (freeride.backends.schedule)."""

from __future__ import annotations

import contextlib
import itertools
import random
from collections import defaultdict, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

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


# --- against the frameworks ---------------------------------------------------------------------------


def test_1f1b_matches_deepspeed_train_schedule() -> None:
    ds_schedule = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    for p, m in itertools.product(range(1, 5), range(1, 9)):
        ours = one_f_one_b(p, m)
        for s in range(p):
            train = ds_schedule.TrainSchedule(micro_batches=m, stages=p, stage_id=s)
            order: list[Action] = []
            counts = {"F": 0, "B": 0}
            for step_id, cmds in enumerate(train.steps()):
                for cmd in cmds:
                    if isinstance(cmd, ds_schedule.ForwardPass | ds_schedule.BackwardPass):
                        kind: Any = "F" if isinstance(cmd, ds_schedule.ForwardPass) else "B"
                        # DeepSpeed names a buffer, not a micro-batch: recover the id from the step.
                        microbatch, is_forward = train._step_to_micro_batch(step_id)
                        assert is_forward == (kind == "F")
                        assert microbatch == counts[kind]  # passes run in micro-batch order
                        assert cmd.buffer_id == microbatch % train.num_pipe_buffers()
                        counts[kind] += 1
                        order.append(Action(s, kind, microbatch))
            assert tuple(order) == ours.actions[s], (p, m, s)


def _megatron_helper_order(megatron: Any, p: int, m: int, v: int, s: int) -> list[Action]:
    """Rank s's order from megatron-core's own table, warm-up count and order helpers."""
    from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order

    table = megatron.get_schedule_table(m, v, p)
    communicator = mock.Mock(virtual_pipeline_model_parallel_size=v)
    communicator.pp_group.size.return_value = p
    communicator.pp_group.rank.return_value = s
    _, _, warm, _ = megatron.get_pp_rank_microbatches(m, v, p, p2p_communicator=communicator)
    forwards = iter(table)
    in_flight: dict[int, deque[int]] = defaultdict(deque)
    order: list[Action] = []
    for signed_chunk in convert_schedule_table_to_order(warm, v, table):
        chunk = abs(signed_chunk) - 1
        if signed_chunk > 0:
            microbatch, table_chunk = next(forwards)
            assert table_chunk == chunk
            in_flight[chunk].append(microbatch)
            order.append(Action(s, "F", microbatch, chunk))
        else:  # backward pops the oldest activation of the chunk, as the schedule's pop(0) does
            order.append(Action(s, "B", in_flight[chunk].popleft(), chunk))
    return order


def _megatron_executed_order(megatron: Any, p: int, m: int, v: int | None, s: int) -> list[Action]:
    """Run megatron-core's schedule function for rank s with recording stand-ins for compute and p2p."""
    import torch
    from megatron.core.enums import ModelType
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(
        pipeline_model_parallel_size=p,
        virtual_pipeline_model_parallel_size=v,
        microbatch_group_size_per_vp_stage=p,
        batch_p2p_comm=False,
        pipeline_dtype=torch.float32,
    )
    # The schedules read these two TransformerConfig fields; a plain ModelParallelConfig lacks them.
    vars(config).update(hidden_size=1, fine_grained_activation_offloading=False)
    order: list[Action] = []

    class Chunk(torch.nn.Module):
        def __init__(self, chunk: int) -> None:
            super().__init__()
            self.chunk, self.config, self.model_type = chunk, config, ModelType.encoder_or_decoder

    def forward_step(*args: Any, current_microbatch: int, **kwargs: Any) -> tuple[Any, torch.Tensor]:
        chunk = args[2].chunk
        order.append(Action(s, "F", current_microbatch, chunk))
        return ((chunk, current_microbatch),), torch.zeros((), dtype=torch.int)

    def backward_step(input_tensor: Any, output_tensor: Any, *args: Any) -> None:
        (chunk, microbatch) = output_tensor[0]
        order.append(Action(s, "B", microbatch, chunk))

    communicator = mock.Mock(config=config, virtual_pipeline_model_parallel_size=v)
    communicator.pp_group.size.return_value = p
    communicator.pp_group.rank.return_value = s
    for name in ("recv_forward", "recv_backward", "send_forward_recv_backward", "send_backward_recv_forward"):
        getattr(communicator, name).return_value = None
    communicator.send_forward_recv_forward.return_value = None
    communicator.send_backward_recv_backward.return_value = None
    communicator.send_forward_backward_recv_forward_backward.return_value = (None, None)
    groups = mock.Mock()
    groups.cp.size.return_value = 1
    groups.tp.size.return_value = 1
    model = [Chunk(c) for c in range(v or 1)]
    function = (
        megatron.forward_backward_pipelining_without_interleaving
        if v is None
        else megatron.forward_backward_pipelining_with_interleaving
    )
    with (
        mock.patch.object(megatron, "forward_step", forward_step),
        mock.patch.object(megatron, "backward_step", backward_step),
        mock.patch.object(torch.distributed, "is_initialized", return_value=True),
        _cuda_factories_on_cpu(),
    ):
        function(
            forward_step_func=None,
            data_iterator=[None] * len(model),
            model=model,
            num_microbatches=m,
            seq_length=1,
            micro_batch_size=1,
            p2p_communicator=communicator,
            pg_collection=groups,
        )
    return order


def _cuda_factories_on_cpu() -> contextlib.AbstractContextManager[Any]:
    """The schedules allocate a token counter with device="cuda"; keep it on the CPU."""
    import torch

    class CudaToCpu(torch.overrides.TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            kwargs = dict(kwargs or {})
            if kwargs.get("device") == "cuda":
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    return CudaToCpu()


MEGATRON_CASES = [(2, 4, 2), (4, 8, 2), (2, 2, 2), (3, 6, 3), (4, 4, 2)]


@pytest.mark.parametrize(("p", "m", "v"), MEGATRON_CASES)
def test_interleaved_matches_megatron_helpers(p: int, m: int, v: int) -> None:
    megatron = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    ours = interleaved(p, m, v)
    for s in range(p):
        assert tuple(_megatron_helper_order(megatron, p, m, v, s)) == ours.actions[s], s


@pytest.mark.parametrize(("p", "m", "v"), MEGATRON_CASES)
def test_interleaved_matches_what_megatron_executes(p: int, m: int, v: int) -> None:
    megatron = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    ours = interleaved(p, m, v)
    for s in range(p):
        assert tuple(_megatron_executed_order(megatron, p, m, v, s)) == ours.actions[s], s


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (3, 2)])
def test_1f1b_matches_what_megatron_executes(p: int, m: int) -> None:
    megatron = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    ours = one_f_one_b(p, m)
    for s in range(p):
        assert tuple(_megatron_executed_order(megatron, p, m, None, s)) == ours.actions[s], s
