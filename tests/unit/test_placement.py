"""Placement: a task goes only where its peak memory fits beside the stage."""

from __future__ import annotations

from freeride.serve.placement import DeviceView, NoFit, better_device, place

G = 1 << 30


def view(
    device: str, spare: int, *, committed: int = 0, tasks: int = 0, share: float = 0.2, alive: bool = True
) -> DeviceView:
    return DeviceView(
        device=device, spare_memory=spare, committed_memory=committed, tasks=tasks, bubble_share=share, alive=alive
    )


def test_no_devices_means_wait() -> None:
    assert place(1 * G, []) is None


def test_only_devices_that_fit() -> None:
    devices = [view("cuda:0", 3 * G), view("cuda:1", 9 * G), view("cuda:2", 16 * G)]
    assert place(10 * G, devices) == "cuda:2"


def test_memory_of_tasks_already_there_counts() -> None:
    devices = [view("cuda:0", 8 * G, committed=6 * G), view("cuda:1", 4 * G)]
    assert place(3 * G, devices) == "cuda:1"


def test_fewest_tasks_then_most_bubble_time() -> None:
    devices = [view("a", 8 * G, tasks=1), view("b", 8 * G, share=0.1), view("c", 8 * G, share=0.3)]
    assert place(1 * G, devices) == "c"


def test_nothing_fits_explains_why() -> None:
    result = place(20 * G, [view("cuda:0", 3 * G), view("cuda:1", 9 * G)])
    assert isinstance(result, NoFit)
    assert "20.00 GiB" in result.reason and "9.00 GiB" in result.reason and "cuda:1" in result.reason


def test_pinned_device_must_fit() -> None:
    assert place(1 * G, [view("cuda:0", 8 * G), view("cuda:1", 8 * G)], pinned="cuda:1") == "cuda:1"
    assert isinstance(place(9 * G, [view("cuda:1", 8 * G)], pinned="cuda:1"), NoFit)
    assert place(1 * G, [view("cuda:0", 8 * G)], pinned="cuda:7") is None


def test_unknown_sizes_fit() -> None:
    assert place(-1, [view("cpu:0", 1)]) == "cpu:0"
    assert place(5 * G, [view("cpu:0", -1)]) == "cpu:0"


def test_live_devices_are_preferred() -> None:
    assert place(1 * G, [view("a", 8 * G, alive=False), view("b", 2 * G)]) == "b"


# -- bubble capacity ------------------------------------------------------------


def test_the_device_with_the_most_bubble_time_wins_over_the_first_one_known() -> None:
    # the report that started it: a task on the stage idle 0.5 % of its step, the other idle 77 %
    devices = [view("cpu:0", 8 * G, share=0.005), view("cpu:1", 8 * G, share=0.77)]
    assert place(1 * G, devices) == "cpu:1"


def test_capacity_is_shared_by_the_tasks_placed_there() -> None:
    # 0.6 shared by two tasks is 0.3 each; 0.4 alone beats it, 0.25 alone does not
    assert place(1 * G, [view("a", 8 * G, share=0.6, tasks=2), view("b", 8 * G, share=0.4)]) == "b"
    assert place(1 * G, [view("a", 8 * G, share=0.6, tasks=1), view("b", 8 * G, share=0.25)]) == "a"


def test_a_device_with_negligible_bubbles_is_used_only_when_no_better_one_exists() -> None:
    crowded = view("busy", 8 * G, share=0.3, tasks=20)  # 1.5 % each: still better than 1 % alone
    assert place(1 * G, [view("thin", 8 * G, share=0.01), crowded]) == "busy"
    assert place(1 * G, [view("thin", 8 * G, share=0.01), view("unknown", 8 * G, share=-1)]) == "unknown"
    assert place(1 * G, [view("thin", 8 * G, share=0.01)]) == "thin"


def test_memory_still_decides_before_bubbles() -> None:
    devices = [view("small", 2 * G, share=0.8), view("big", 16 * G, share=0.1)]
    assert place(4 * G, devices) == "big"
    assert isinstance(place(32 * G, devices), NoFit)


# -- moving ------------------------------------------------------------------------


def test_a_task_moves_only_for_a_large_gain() -> None:
    here = view("a", 8 * G, share=0.3, tasks=1)
    assert better_device("a", 1 * G, [here, view("b", 8 * G, share=0.6)], gain=1.5, min_gain_share=0.02) == (
        "b",
        0.3,
        0.6,
    )
    assert better_device("a", 1 * G, [here, view("b", 8 * G, share=0.4)], gain=1.5, min_gain_share=0.02) is None


def test_a_gain_of_a_sliver_is_no_reason_to_move() -> None:
    here = view("a", 8 * G, share=0.004, tasks=1)
    assert better_device("a", 1 * G, [here, view("b", 8 * G, share=0.01)], gain=1.5, min_gain_share=0.02) is None


def test_no_move_while_the_shares_are_unknown_or_to_where_the_task_does_not_fit() -> None:
    unknown_here = view("a", 8 * G, share=-1, tasks=1)
    assert better_device("a", 1 * G, [unknown_here, view("b", 8 * G, share=0.9)], gain=1.5, min_gain_share=0) is None
    here = view("a", 8 * G, share=0.05, tasks=1)
    for other in (view("b", 8 * G, share=-1), view("b", 1 * G, share=0.9), view("b", 8 * G, share=0.9, alive=False)):
        assert better_device("a", 2 * G, [here, other], gain=1.5, min_gain_share=0) is None


def test_a_task_on_a_device_not_training_yet_stays() -> None:
    # a profiled stage whose rank has not reported yet, while another one has
    waiting = view("a", 8 * G, share=0.3, tasks=1, alive=False)
    assert better_device("a", 1 * G, [waiting, view("b", 8 * G, share=0.9)], gain=1.5, min_gain_share=0.02) is None
