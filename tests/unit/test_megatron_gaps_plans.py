"""Megatron's forward-only calls, the tail inside ``finalize_model_grads_func``, and their plans.

Pure: megatron-core is imported for its own warm-up counts (no process
groups, no GPU); the tracker runs on an injected clock with a recording sink.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from freeride.backends.megatron import _compat
from freeride.backends.megatron.adapter import MegatronAdapter
from freeride.backends.megatron.patches import wrap_finalize
from freeride.backends.megatron.plan import iterations, megatron_schedule
from freeride.backends.schedule import Action, Durations, Schedule, forward_only, one_f_one_b
from freeride.backends.tracker import TAIL_KEY, StepPlan, StepTracker, schedule_priors

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")

MS = 1_000_000


def _megatron_warmup(p: int, stage: int, m: int, v: int | None, group: int, *, forward_only: bool) -> int:
    comm = SimpleNamespace(
        pp_group=SimpleNamespace(size=lambda: p, rank=lambda: stage), virtual_pipeline_model_parallel_size=v
    )
    _, _, warm, _ = schedules.get_pp_rank_microbatches(
        m, v or 1, group, forward_only=forward_only, p2p_communicator=comm
    )
    return int(warm)


# --------------------------------------------------------------------------
# forward-only plans
# --------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "p", "m", "v"), [("1f1b", 2, 4, 1), ("1f1b", 4, 3, 1), ("interleaved", 2, 4, 2)])
def test_forward_only_plan_is_megatrons_forward_order(name: str, p: int, m: int, v: int) -> None:
    schedule = megatron_schedule(name, p, m, v, p, forward_only=True)
    assert schedule.forward_only and schedule.name == f"{name}-forward"
    table = [tuple(x) for x in schedules.get_schedule_table(m, v, p)] if v > 1 else [(mb, 0) for mb in range(m)]
    for stage in range(p):
        row = schedule.actions[stage]
        # megatron runs every forward of a forward-only call as a warm-up forward, in table order
        warm = _megatron_warmup(p, stage, m, v if v > 1 else None, p, forward_only=True)
        assert warm == len(row) == m * v
        assert [(a.microbatch, a.chunk) for a in row] == table
        assert {a.kind for a in row} == {"F"}
        assert iterations(schedule, stage) == (1,) * len(row)  # one receive before each forward


def test_forward_only_schedule_is_validated() -> None:
    training = one_f_one_b(2, 2)
    with pytest.raises(ValueError, match="must run F of each"):
        Schedule("x", 2, 2, 1, training.actions, forward_only=True)
    with pytest.raises(ValueError, match="must run F and B"):
        Schedule("x", 2, 2, 1, forward_only(training).actions)
    rows = tuple((*row, Action(s, "W", 0)) for s, row in enumerate(forward_only(training).actions))
    with pytest.raises(ValueError, match="forward-only schedule lists W"):
        Schedule("x", 2, 2, 1, rows, forward_only=True)


def test_forward_only_bubbles_are_the_fill_only() -> None:
    """Rank s waits s forwards for its first input, then never: its tail is no wait of its own."""
    p, m, f, b = 4, 4, 1.0, 2.0
    durations = Durations.uniform(p, f, b)
    fwd = megatron_schedule("1f1b", p, m, 1, p, forward_only=True)
    train = megatron_schedule("1f1b", p, m, 1, p)
    for stage in range(p):
        priors = schedule_priors(fwd, stage, durations, merge_tail=False)
        head = {Action(stage, "F", 0): round(stage * f * 1e9)} if stage else {}
        tail = {None: round((p - 1 - stage) * f * 1e9)} if stage < p - 1 else {}
        assert priors == head | tail
        # training's plan waits elsewhere too (for backwards): the plans differ
        assert schedule_priors(train, stage, durations, merge_tail=False) != priors


class _Sink:
    def __init__(self) -> None:
        self.started: list[tuple[int, int]] = []
        self.ended = 0
        self.finished: list[int] = []

    def bubble_started(self, step: int, expected_ns: int, *, spare_memory: int | None = None) -> bool:
        self.started.append((step, expected_ns))
        return True

    def bubble_ended(self) -> int:
        self.ended += 1
        return 0

    def step_finished(self, step: int, duration_ns: int) -> None:
        self.finished.append(step)


class _Clock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def _run(tracker: StepTracker, clock: _Clock, plan: StepPlan, waits: dict[str, int], compute_ns: int) -> None:
    """One step: before each action its wait (if any, by place key), then the action; then the tail wait."""
    tracker.begin_step(plan)
    for action in plan.actions:
        key = str(action)
        if key in waits:
            tracker.wait_started()
            clock.ns += waits[key]
            tracker.wait_ended()
        tracker.action_started(action.kind)
        clock.ns += compute_ns
        tracker.record_compute(action.kind, compute_ns)
    if TAIL_KEY in waits:
        tracker.wait_started()
        clock.ns += waits[TAIL_KEY]
        tracker.wait_ended()
    tracker.end_step()


def test_an_evaluation_before_any_backward_is_predicted_from_forwards_alone() -> None:
    sink, clock = _Sink(), _Clock()
    tracker = StepTracker(sink, clock=clock)
    fwd = megatron_schedule("1f1b", 2, 4, 1, 2, forward_only=True)
    plan = StepPlan(schedule=fwd, stage=1, merge_tail=False)
    _run(tracker, clock, plan, {"1F0": 10 * MS}, 10 * MS)  # learns the forward time
    _run(tracker, clock, plan, {"1F0": 10 * MS}, 10 * MS)
    assert sink.started == [(1, 10 * MS)]  # second call: the head, one forward of stage 0
    assert sink.ended == 1 and sink.finished == [0, 1]


def test_training_plan_survives_evaluation_calls_between_steps(caplog: pytest.LogCaptureFixture) -> None:
    """Each call is checked against its own plan: an eval call does not break training's."""
    sink, clock = _Sink(), _Clock()
    tracker = StepTracker(sink, clock=clock)
    train = StepPlan(schedule=megatron_schedule("1f1b", 2, 2, 1, 2), stage=1, merge_tail=False)
    evaluate = StepPlan(schedule=megatron_schedule("1f1b", 2, 2, 1, 2, forward_only=True), stage=1, merge_tail=False)
    for _ in range(3):
        _run(tracker, clock, train, {"1F0": 10 * MS, "1F1": 20 * MS, TAIL_KEY: 20 * MS}, 10 * MS)
        _run(tracker, clock, evaluate, {"1F0": 12 * MS}, 10 * MS)
    assert "no longer announced" not in caplog.text
    by_step = {step: ns for step, ns in sink.started}
    assert {4, 5} <= set(by_step)  # a training step and an eval call, both announced
    assert by_step[5] == 12 * MS  # the eval head as measured, not training's


# --------------------------------------------------------------------------
# the tail inside finalize_model_grads_func
# --------------------------------------------------------------------------


def test_finalize_tail_is_predicted_at_the_tail_place() -> None:
    """With a finalize call the tail is a wait of its own (tail place), not merged into the next step."""
    sink, clock = _Sink(), _Clock()
    tracker = StepTracker(sink, clock=clock)
    schedule = megatron_schedule("1f1b", 2, 4, 1, 2)
    plan = StepPlan(schedule=schedule, stage=1, merge_tail=False)
    f, b = 10 * MS, 10 * MS
    gaps = schedule_priors(schedule, 1, Durations.uniform(2, f / 1e9, b / 1e9), merge_tail=False)
    assert gaps[None] == b  # the last stage waits one backward of stage 0 in the finalize call
    merged = schedule_priors(schedule, 1, Durations.uniform(2, f / 1e9, b / 1e9), merge_tail=True)
    assert None not in merged and merged[Action(1, "F", 0)] == f + b
    _run(tracker, clock, plan, {TAIL_KEY: b}, f)  # the first step learns the compute times
    sink.started.clear()
    _run(tracker, clock, plan, {TAIL_KEY: b}, f)
    assert sink.started == [(1, b)]
    assert tracker.last_step is not None and [w.key for w in tracker.last_step.waits] == [TAIL_KEY]


def test_wrap_finalize_is_idempotent_and_transparent_outside_a_tracked_step() -> None:
    calls: list[tuple[Any, ...]] = []

    def finalize(*args: Any, **kwargs: Any) -> str:
        calls.append((args, kwargs))
        return "done"

    config = SimpleNamespace(finalize_model_grads_func=finalize)
    wrap_finalize(config)
    wrapped = config.finalize_model_grads_func
    assert wrapped is not finalize and wrapped.__wrapped__ is finalize
    wrap_finalize(config)
    assert config.finalize_model_grads_func is wrapped
    assert wrapped([1], None, force_all_reduce=False) == "done"
    assert calls == [(([1], None), {"force_all_reduce": False})]
    empty = SimpleNamespace(finalize_model_grads_func=None)
    wrap_finalize(empty)
    assert empty.finalize_model_grads_func is None


def test_plans_of_training_and_evaluation_calls() -> None:
    info = _compat.CallInfo(
        num_stages=2,
        stage=1,
        num_microbatches=4,
        num_chunks=1,
        group_size=2,
        forward_only=True,
        overlap_p2p_comm=False,
        combined_1f1b=False,
        has_finalize=True,
        config=None,
    )
    evaluate = MegatronAdapter._plan("1f1b", info)
    assert evaluate.schedule.forward_only and not evaluate.merge_tail
    train = MegatronAdapter._plan("1f1b", dataclasses.replace(info, forward_only=False))
    assert not train.schedule.forward_only and not train.merge_tail  # finalize: the tail is its own wait
    no_sync = MegatronAdapter._plan("1f1b", dataclasses.replace(info, forward_only=False, has_finalize=False))
    assert no_sync.merge_tail
    assert len({evaluate.key, train.key}) == 2  # predictions are learned per plan
