"""A task's state copied to host memory a slice at a time: what comes out is the state, whatever it holds."""

from __future__ import annotations

import threading
from collections import OrderedDict, namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch

from freeride.worker.checkpoint import load_checkpoint, write_checkpoint
from freeride.worker.snapshot import StateCopy, StateWriter

Pair = namedtuple("Pair", ["a", "b"])


def _copied(state: object, slice_bytes: int) -> tuple[object, int]:
    copy = StateCopy(state)
    slices = 0
    while not copy.done:
        assert copy.copy(slice_bytes) > 0
        slices += 1
    assert copy.copied == copy.total
    return copy.result(), slices


def test_a_module_and_optimizer_state_come_out_equal_and_apart_from_the_live_tensors() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "steps": 3}
    out, slices = _copied(state, 4096)
    assert slices > 4  # sliced, not copied in one go
    assert isinstance(out, dict)
    assert isinstance(out["model"], OrderedDict) and out["model"]._metadata == state["model"]._metadata
    for name, tensor in state["model"].items():
        assert torch.equal(out["model"][name], tensor)
        assert out["model"][name].data_ptr() != tensor.data_ptr()
    assert out["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert torch.equal(out["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    with torch.no_grad():  # the live model moves on; the copy does not
        model[0].weight.add_(1.0)
    assert not torch.equal(out["model"]["0.weight"], model[0].weight)


def test_arrays_named_tuples_views_and_values_that_need_grad_survive() -> None:
    base = torch.arange(24.0).reshape(4, 6)
    param = torch.nn.Parameter(torch.ones(5))
    state = {
        "array": np.arange(1000, dtype=np.int64),
        "pair": Pair(torch.full((3,), 2.0), "name"),
        "view": base.t(),  # not contiguous: copied whole
        "param": param,
        "nested": [(1, 2.5), {"x": np.float64(1.5)}],
    }
    out, _ = _copied(state, 512)
    assert isinstance(out, dict)
    assert np.array_equal(out["array"], state["array"])
    assert isinstance(out["pair"], Pair) and torch.equal(out["pair"].a, state["pair"].a) and out["pair"].b == "name"
    assert torch.equal(out["view"], base.t())
    assert torch.equal(out["param"], param.detach()) and not out["param"].requires_grad
    assert out["nested"] == [(1, 2.5), {"x": 1.5}]


def test_a_tensor_held_twice_is_copied_once_and_stays_one_tensor() -> None:
    tied = torch.randn(100)
    copy = StateCopy({"embed": tied, "head": tied})
    assert copy.total == tied.nbytes
    while not copy.done:
        copy.copy(64)
    out = copy.result()
    assert isinstance(out, dict) and out["embed"] is out["head"]


def test_the_result_is_refused_before_the_copy_is_whole() -> None:
    copy = StateCopy({"w": torch.zeros(1000)})
    copy.copy(100)
    with pytest.raises(RuntimeError, match="not wholly copied"):
        copy.result()


def test_the_writer_writes_a_checkpoint_a_worker_loads_and_keeps_a_failure_for_the_task(tmp_path: Path) -> None:
    state = {"w": torch.randn(1000), "steps_seen": 7}
    writer = StateWriter(write_checkpoint, state, tmp_path / "t.pt", steps=12, began_ns=5)
    writer.wait()
    assert writer.done and writer.error == ""
    saved = load_checkpoint(tmp_path / "t.pt")
    assert saved["steps"] == 12 and torch.equal(saved["state"]["w"], state["w"])

    names: list[str] = []

    def failing(state: object, path: Path, steps: int) -> None:
        names.append(threading.current_thread().name)
        raise OSError(28, "No space left on device")

    writer = StateWriter(failing, state, tmp_path / "u.pt", steps=13, began_ns=6)
    writer.wait()
    assert writer.error == "OSError: [Errno 28] No space left on device"
    assert names == ["freeride-checkpoint-13"]  # its own thread, never the task's
