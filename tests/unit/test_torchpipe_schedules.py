"""torch 2.13's seven pipeline schedules, read by the torchpipe adapter as FreeRide plans.

Each schedule is built by torch itself, on real ``PipelineStage``\\ s, as rank 0
of a pipeline group of 2 or 4 ranks. The other ranks cannot exist in one unit
test process, so the group is torch's in-process fake process group (a stand-in:
no message is ever sent; building a schedule only reads the group's size and
rank). The adapter then reads the schedule's own action lists (every rank's)
and the plan must be what torch runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import pipelining as pp
from torch.testing._internal.distributed.fake_pg import FakeStore

from freeride.backends.schedule import Action, Durations, Schedule, gpipe, interleaved, one_f_one_b, simulate
from freeride.backends.torchpipe import _compat
from freeride.backends.torchpipe.adapter import TorchPipeAdapter
from freeride.backends.torchpipe.translate import COMPUTE_KINDS, NON_COMPUTE

ALL = (
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleLoopedBFS",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
SINGLE = ("ScheduleGPipe", "Schedule1F1B")
M = 8


class _Sink:
    """Stands in for a BackendSession."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(endpoint="ipc:///nonexistent/events")
        self.sent = 0

    def bubble_started(self, step: int, expected_ns: int, *, spare_memory: int | None = None) -> bool:
        return True

    def bubble_ended(self) -> int:
        return 0

    def step_finished(self, step: int, duration_ns: int) -> None:
        pass

    def heartbeat(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture(scope="module", params=[2, 4], ids=["p2", "p4"])
def ranks(request: pytest.FixtureRequest) -> Iterator[int]:
    p = int(request.param)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=p)
    try:
        yield p
    finally:
        dist.destroy_process_group()


def _build(name: str, p: int, m: int = M) -> Any:
    cls = getattr(pp, name)
    if name in SINGLE:
        indices, total = [0], p
    elif name in V_SHAPED:
        indices, total = [0, 2 * p - 1], 2 * p
    else:
        indices, total = [0, p], 2 * p
    stages = [pp.PipelineStage(torch.nn.Linear(2, 2), i, total, torch.device("cpu")) for i in indices]
    return cls(stages[0] if name in SINGLE else stages, m, loss_fn=lambda out, target: out.sum())


def _plan(schedule: Any) -> Schedule:
    adapter = TorchPipeAdapter(schedule, session=_Sink(), mode="emit")  # type: ignore[arg-type]
    assert adapter.plan is not None
    adapter.close()
    return adapter.plan.schedule


def test_torch_has_all_seven_schedules() -> None:
    assert all(hasattr(pp, name) for name in ALL)


@pytest.mark.parametrize("name", ALL)
def test_every_action_type_torch_lists_is_known(ranks: int, name: str) -> None:
    rows = _compat.schedule_actions(_build(name, ranks))
    assert rows is not None and sorted(rows) == list(range(ranks))
    letters = {letter for row in rows.values() for _, letter, _ in row}
    assert letters <= set(COMPUTE_KINDS) | NON_COMPUTE, letters


@pytest.mark.parametrize("name", ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B"])
def test_the_classic_schedules_are_ours(ranks: int, name: str) -> None:
    """GPipe and 1F1B are the loops torch runs; interleaved 1F1B's lists are Megatron's order too."""
    expected = {
        "ScheduleGPipe": lambda: gpipe(ranks, M),
        "Schedule1F1B": lambda: one_f_one_b(ranks, M),
        "ScheduleInterleaved1F1B": lambda: interleaved(ranks, M, 2),
    }[name]()
    assert _plan(_build(name, ranks)).actions == expected.actions


def test_looped_bfs_runs_every_forward_chunk_by_chunk_then_the_backwards_in_reverse(ranks: int) -> None:
    plan = _plan(_build("ScheduleLoopedBFS", ranks))
    for rank, row in enumerate(plan.actions):
        forwards = [Action(rank, "F", mb, c) for c in (0, 1) for mb in range(M)]
        backwards = [Action(rank, "B", mb, c) for c in (1, 0) for mb in reversed(range(M))]
        assert list(row) == forwards + backwards


@pytest.mark.parametrize("name", ["ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"])
def test_zero_bubble_schedules_split_every_backward(ranks: int, name: str) -> None:
    plan = _plan(_build(name, ranks))
    assert plan.num_chunks == 2 and plan.has_weight_passes
    for row in plan.actions:
        weights = [(a.microbatch, a.chunk) for a in row if a.kind == "W"]
        assert sorted(weights) == [(mb, c) for mb in range(M) for c in (0, 1)]
        for a in row:  # each W after the B (input gradient) it finishes
            if a.kind == "W":
                assert row.index(Action(a.stage, "B", a.microbatch, a.chunk)) < row.index(a)


def test_interleaved_zero_bubble_replays_without_deadlock(ranks: int) -> None:
    """Loop-placed, so the simulator follows the right neighbours: torch's lists are a consistent schedule."""
    plan = _plan(_build("ScheduleInterleavedZeroBubble", ranks))
    timeline = simulate(plan, Durations.uniform(ranks, forward=1.0, backward=1.0, weight=1.0))
    assert timeline.makespan > 0


def test_dualpipev_overlapped_pairs_become_a_forward_then_a_backward(ranks: int) -> None:
    schedule = _build("ScheduleDualPipeV", ranks)
    overlapped = [a for a in schedule.pipeline_order[0] if a is not None and a.sub_actions]
    assert overlapped, "DualPipeV pairs a forward with a backward"
    rows = _compat.schedule_actions(schedule)
    assert rows is not None
    plan = _plan(schedule)
    row = [str(a) for a in plan.actions[0]]
    chunk = {0: 0, 2 * ranks - 1: 1}
    for pair in overlapped:
        f, b = (
            Action(0, COMPUTE_KINDS[s.computation_type.value], s.microbatch_index, chunk[s.stage_index])
            for s in pair.sub_actions
        )
        assert (f.kind, b.kind) == ("F", "B")
        assert row.index(str(b)) == row.index(str(f)) + 1  # torch runs them one after the other


def test_dualpipev_mixes_full_and_split_backwards(ranks: int) -> None:
    """A full backward (torch's B) has no W; a split one (torch's I) has its W later: both are our B."""
    plan = _plan(_build("ScheduleDualPipeV", ranks))
    for row in plan.actions:
        split = {(a.microbatch, a.chunk) for a in row if a.kind == "W"}
        assert 0 < len(split) < 2 * M
    assert plan.num_chunks == 2


@pytest.mark.parametrize("name", ALL)
def test_only_loop_placed_plans_are_simulated(ranks: int, name: str) -> None:
    adapter = TorchPipeAdapter(_build(name, ranks), session=_Sink(), mode="emit")  # type: ignore[arg-type]
    assert adapter.plan is not None
    assert adapter.plan.simulated is (name not in V_SHAPED)
    assert adapter.facts.name == name and adapter.facts.num_ranks == ranks
    adapter.close()
