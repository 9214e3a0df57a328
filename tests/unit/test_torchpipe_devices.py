"""Which device a torchpipe rank reports: its GPU, its core, or (more ranks than cores) its local rank."""

from __future__ import annotations

import os

import pytest

from freeride.backends.torchpipe.adapter import device_name


def _node(monkeypatch: pytest.MonkeyPatch, *, cores: int, ranks: int, local: int, pinned: int | None) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {pinned} if pinned is not None else set(range(cores)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    monkeypatch.setenv("LOCAL_RANK", str(local))


def test_a_gpu_is_named_by_its_index(monkeypatch: pytest.MonkeyPatch) -> None:
    _node(monkeypatch, cores=2, ranks=8, local=5, pinned=None)
    assert device_name("cuda", 5) == "cuda:5"


@pytest.mark.parametrize(("local", "pinned", "name"), [(0, 0, "cpu:0"), (1, 1, "cpu:1"), (1, None, "cpu:1")])
def test_a_cpu_rank_is_its_core(monkeypatch: pytest.MonkeyPatch, local: int, pinned: int | None, name: str) -> None:
    _node(monkeypatch, cores=4, ranks=2, local=local, pinned=pinned)
    assert device_name("cpu", 0) == name


def test_ranks_sharing_a_core_stay_distinct_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    names = []
    for local in range(4):
        _node(monkeypatch, cores=2, ranks=4, local=local, pinned=local % 2)
        names.append(device_name("cpu", 0))
    assert names == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
