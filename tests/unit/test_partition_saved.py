"""A restarted partitioned task takes its plan back from its checkpoint: no profiling before its first bubble.

The worker tells setup that a checkpoint follows (``TaskContext.restoring``);
the plan then comes from that checkpoint, loaded with weights only, unless it
no longer fits the model or the steps wanted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import test_partition as cnn
import test_partition_models as hf
import torch
from _torchfix import deterministic_one_thread  # noqa: F401 - autouse fixture

from freeride.partition import training
from freeride.partition.saved import plan_state, reused_plan
from freeride.partition.update import ChunkedUpdate
from freeride.worker.checkpoint import load_checkpoint


def _saved(task: Any, tmp_path: Path) -> dict[str, Any]:
    """The task's state as a worker's checkpoint gives it back (written, then loaded with weights only)."""
    path = tmp_path / "task.pt"
    torch.save({"steps": 0, "state": task.state_dict()}, path)
    return load_checkpoint(path)["state"]


def _no_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    def profiled(*args: Any, **kw: Any) -> Any:
        raise AssertionError("profiled again")

    monkeypatch.setattr(training, "make_plan", profiled)
    monkeypatch.setattr(ChunkedUpdate, "profile", profiled)


def _restoring() -> Any:
    return dataclasses.replace(cnn._ctx(), restoring=True)


def _kinds(task: Any) -> list[str]:
    return [s.kind for s in (*task.plan.forward, *task.plan.backward)] + list(task._chunk_kinds)


@pytest.mark.parametrize("case", ["mobilenet-sgd", "lm-sgd"])
def test_a_restart_takes_the_plan_back_and_trains_as_if_never_stopped(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    task = cnn._started(case)
    cnn._run_batches(task, 1)
    task.step()  # mid-batch
    state = _saved(task, tmp_path)

    _no_profiling(monkeypatch)
    restored = cnn._Task(case)
    asyncio.run(restored.setup(_restoring()))
    assert restored.plan is None  # left to the checkpoint that follows
    with caplog.at_level(logging.INFO, logger="freeride.partition"):
        restored.load_state_dict(state)
    assert "the checkpoint's plan reused" in caplog.text
    assert restored.plan is not None and restored.plan.atoms == task.plan.atoms
    assert _kinds(restored) == _kinds(task)  # the same steps: estimates learned before still apply
    cnn._run_batches(restored, 3)
    cnn._assert_same(cnn._plain(case, 3), restored.model)


def test_a_state_handed_over_before_setup_brings_its_plan_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    task = cnn._started("mobilenet-sgd")
    task.step()
    state = _saved(task, tmp_path)
    _no_profiling(monkeypatch)
    restored = cnn._Task("mobilenet-sgd")
    restored.load_state_dict(state)
    asyncio.run(restored.setup(cnn._ctx()))
    cnn._run_batches(restored, 2)
    cnn._assert_same(cnn._plain("mobilenet-sgd", 2), restored.model)


def test_an_exported_models_plan_is_taken_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make, loss_fn, data = hf.CASES["gpt2"]
    torch.manual_seed(0)
    task = hf._Task(make(), loss_fn, data())
    asyncio.run(task.setup(hf._ctx()))
    assert task.plan is not None and task.plan.exported
    task.step()
    state = _saved(task, tmp_path)
    while task.batches_done < 1:  # before the restored task sets the global random stream back
        task.step()

    _no_profiling(monkeypatch)
    torch.manual_seed(0)
    restored = hf._Task(make(), loss_fn, data())
    asyncio.run(restored.setup(_restoring()))
    restored.load_state_dict(state)
    assert restored.plan is not None and restored.plan.exported and _kinds(restored) == _kinds(task)
    while restored.batches_done < 1:
        restored.step()
    for a, b in zip(task.model.parameters(), restored.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(("change", "said"), [("no plan", "none kept"), ("shorter steps", "steps of 0.0 ms wanted")])
def test_a_plan_that_no_longer_holds_is_made_again_and_says_why(
    change: str, said: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    task = cnn._started("mobilenet-sgd", target_ms=0.1)
    task.step()
    state = _saved(task, tmp_path)
    if change == "no plan":
        del state["plan"]  # a checkpoint written before plans were kept
    restored = cnn._Task("mobilenet-sgd", target_ms=0.02 if change == "shorter steps" else 0.1)
    asyncio.run(restored.setup(_restoring()))
    with caplog.at_level(logging.INFO, logger="freeride.partition"):
        restored.load_state_dict(state)
    assert f"the checkpoint's plan is not reused ({said}" in caplog.text
    assert restored.plan is not None and restored.batches_done == 0
    cnn._run_batches(restored, 1)
    cnn._assert_same(cnn._plain("mobilenet-sgd", 1), restored.model)


def test_the_plan_of_another_model_is_not_taken(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    task = cnn._started("mobilenet-sgd")
    other = cnn._started("skipnet-adam")
    x, _ = cnn.CASES["skipnet-adam"][3][0]
    with caplog.at_level(logging.INFO, logger="freeride.partition"):
        assert reused_plan(other.model, x, plan_state(task.plan), target_s=task.target_s, training=True) is None
    assert "SkipNet: the checkpoint's plan is of another graph: profiling" in caplog.text


def test_inference_takes_its_plan_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from freeride.partition import inference

    task = cnn._Infer()
    asyncio.run(task.setup(cnn._ctx()))
    task.step()
    state = _saved(task, tmp_path)
    monkeypatch.setattr(inference, "make_plan", lambda *a, **kw: pytest.fail("profiled again"))
    restored = cnn._Infer()
    asyncio.run(restored.setup(_restoring()))
    restored.load_state_dict(state)
    assert restored.plan is not None and restored.plan.atoms == task.plan.atoms
    while restored.batches_done < 3:
        restored.step()
    assert len(restored.outputs) == 3
