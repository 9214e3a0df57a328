"""Megatron's schedules as FreeRide schedules, checked against megatron-core's own code.

These import megatron-core (no process groups, no GPU): its warm-up counts and
interleaved table are the reference for :mod:`freeride.backends.megatron.plan`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from freeride.backends.megatron import _compat
from freeride.backends.megatron.plan import iterations, megatron_schedule, warmup_count
from freeride.backends.schedule import Durations, bubbles, interleaved, one_f_one_b, simulate

schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")


def _megatron_warmup(p: int, stage: int, m: int, v: int | None, group: int) -> int:
    comm = SimpleNamespace(
        pp_group=SimpleNamespace(size=lambda: p, rank=lambda: stage), virtual_pipeline_model_parallel_size=v
    )
    _, _, warm, _ = schedules.get_pp_rank_microbatches(m, v or 1, group, p2p_communicator=comm)
    return int(warm)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (3, 2)])
def test_1f1b_warmup_matches_megatron(p: int, m: int) -> None:
    schedule = megatron_schedule("1f1b", p, m, 1, p)
    assert schedule == one_f_one_b(p, m)
    for stage in range(p):
        warm = _megatron_warmup(p, stage, m, None, p)
        row = schedule.actions[stage]
        assert warmup_count(schedule, stage) == warm
        assert [a.kind for a in row[:warm]] == ["F"] * warm
        assert warm == m or (row[warm].kind == "F" and row[warm + 1].kind == "B")


@pytest.mark.parametrize(
    ("p", "m", "v", "group"), [(2, 4, 2, 2), (4, 8, 2, 4), (2, 6, 3, 2), (2, 5, 2, 3), (2, 8, 2, 4)]
)
def test_interleaved_order_matches_megatrons_table(p: int, m: int, v: int, group: int) -> None:
    schedule = megatron_schedule("interleaved", p, m, v, group)
    table = schedules.get_schedule_table(m, v, group)
    for stage in range(p):
        row = schedule.actions[stage]
        warm = _megatron_warmup(p, stage, m, v, group)
        assert warmup_count(schedule, stage, group) == warm
        forwards = [(a.microbatch, a.chunk) for a in row if a.kind == "F"]
        backwards = [(a.microbatch, v - 1 - a.chunk) for a in row if a.kind == "B"]
        assert forwards == [tuple(x) for x in table]
        assert backwards == forwards  # the k-th backward runs the k-th table entry, mirrored
        assert [a.kind for a in row[:warm]] == ["F"] * warm
    if group == p and m % p == 0:
        assert schedule == interleaved(p, m, v)


def test_unknown_schedule_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="name"):
        megatron_schedule("zero-bubble", 2, 4, 1, 2)


def test_iterations_group_interleaved_steady_state_in_pairs() -> None:
    schedule = megatron_schedule("interleaved", 2, 4, 2, 2)
    for stage in range(2):
        groups = iterations(schedule, stage)
        warm = warmup_count(schedule, stage)
        assert sum(groups) == len(schedule.actions[stage])
        assert groups[:warm] == (1,) * warm and groups[-warm:] == (1,) * warm
        assert set(groups[warm:-warm]) == {2}
        assert iterations(schedule, stage, overlap_p2p_comm=True) == (1,) * len(schedule.actions[stage])
    plain = megatron_schedule("1f1b", 2, 4, 1, 2)
    assert iterations(plain, 0) == (1,) * 8


def test_single_action_iterations_replay_the_plain_simulation() -> None:
    for schedule in (one_f_one_b(4, 8), interleaved(2, 4, 2)):
        durations = Durations(
            forward=(1.0, 1.5, 1.0, 2.0)[: schedule.num_stages], backward=(2.0,) * schedule.num_stages
        )
        ones = tuple((1,) * len(row) for row in schedule.actions)
        assert simulate(schedule, durations, groups=ones) == simulate(schedule, durations)


def test_blocking_iterations_move_interleaved_waits_earlier() -> None:
    """Megatron receives a backward's gradient together with the forward before it."""
    schedule = interleaved(2, 4, 2)
    durations = Durations.uniform(2, 1.0, 2.0)
    groups = tuple(iterations(schedule, s) for s in range(2))
    grouped = bubbles(simulate(schedule, durations, groups=groups))[0]
    plain = bubbles(simulate(schedule, durations))[0]
    first_pair = schedule.actions[0][warmup_count(schedule, 0)]
    assert first_pair.kind == "F"
    assert first_pair in {w.before for w in grouped}
    assert first_pair not in {w.before for w in plain}
    # outputs leave only after the pair, so the pipeline as a whole gets no shorter
    assert simulate(schedule, durations, groups=groups).makespan >= simulate(schedule, durations).makespan
    # where rank 0 waits once its p2p calls block per iteration (the first steady pair, the cool-down)
    assert [str(w.before) for w in grouped] == ["0F2", "0B3c1"]


def test_groups_must_cover_every_row() -> None:
    schedule = one_f_one_b(2, 2)
    with pytest.raises(ValueError, match="groups"):
        simulate(schedule, Durations.uniform(2, 1.0, 2.0), groups=((1,) * 4, (1,) * 3))
    with pytest.raises(ValueError, match="groups"):
        simulate(schedule, Durations.uniform(2, 1.0, 2.0), groups=((2, 0, 2), (1,) * 4))


# ------------------------------------------------------------------ p2p calls


@pytest.mark.parametrize(
    ("method", "args", "kwargs", "receives"),
    [
        ("recv_forward", ([4, 2, 8], False), {}, True),
        ("recv_forward", ([4, 2, 8], True), {}, False),
        ("recv_backward", ([4, 2, 8],), {"is_last_stage": True}, False),
        ("send_forward_recv_backward", (None, [4, 2, 8], False), {}, True),
        ("send_backward_recv_forward", (None, [4, 2, 8], True), {}, False),
        ("send_forward_recv_forward", (None,), {"recv_prev": True, "tensor_shape": [1]}, True),
        ("send_forward_recv_forward", (None,), {"recv_prev": False, "tensor_shape": [1]}, False),
        ("send_forward_recv_forward", (None, True, [1]), {"overlap_p2p_comm": True}, False),
        ("send_backward_recv_backward", (None, True, [1]), {}, True),
        ("send_forward_backward_recv_forward_backward", (None, None), {"recv_prev": False, "recv_next": True}, True),
        ("send_forward_backward_recv_forward_backward", (None, None, False, False, [1]), {}, False),
        ("send_forward", (None, False), {}, False),
    ],
)
def test_which_p2p_calls_wait(method: str, args: tuple[object, ...], kwargs: dict[str, object], receives: bool) -> None:
    assert _compat.call_receives(method, args, kwargs) is receives


def test_receiving_methods_take_their_flags_where_compat_reads_them() -> None:
    import inspect

    cls = _compat.p2p_class()
    assert cls is not None
    positions = {
        "recv_forward": {"is_first_stage": 1},
        "recv_backward": {"is_last_stage": 1},
        "send_forward_recv_backward": {"is_last_stage": 2},
        "send_backward_recv_forward": {"is_first_stage": 2},
        "send_forward_recv_forward": {"recv_prev": 1},
        "send_backward_recv_backward": {"recv_next": 1},
        "send_forward_backward_recv_forward_backward": {"recv_prev": 2, "recv_next": 3},
    }
    assert positions.keys() == _compat.RECEIVING_METHODS.keys()
    for method, flags in positions.items():
        params = list(inspect.signature(getattr(cls, method)).parameters)[1:]  # after self
        assert {name: params.index(name) for name in flags} == flags, method
    assert callable(getattr(_compat.p2p_module(), _compat.P2P_OPS))
    for name in (*_compat.SCHEDULE_FUNCTIONS, *_compat.STEP_FUNCTIONS):
        assert callable(getattr(schedules, name))


def test_installed_megatron_is_a_checked_version() -> None:
    assert _compat.megatron_version() in _compat.TESTED_VERSIONS
