"""Placement: a task goes only where its peak memory fits beside the stage."""

from __future__ import annotations

from freeride.serve.placement import DeviceView, NoFit, place

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
