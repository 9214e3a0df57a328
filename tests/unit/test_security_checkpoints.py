"""Checkpoints load weights-only: every sample task's state round-trips; a planted pickle runs nothing."""

from __future__ import annotations

import asyncio
import math
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _sidetaskfix import cpu_context
from _torchfix import deterministic_one_thread  # noqa: F401 - autouse fixture

from freeride.sidetask import IterativeTask, UnboundedGate, run_alone
from freeride.sidetasks.graph_sgd import GraphSGD
from freeride.sidetasks.imaging import ImageProcessing
from freeride.sidetasks.pagerank import PageRank
from freeride.sidetasks.vision import ResNet18Inference, ResNet18Training
from freeride.worker.checkpoint import UnsafeCheckpoint, load_checkpoint
from freeride.worker.main import _read_checkpoint, _restore, _save_checkpoint

TINY: dict[str, Any] = {"image_size": 16, "num_classes": 4, "batch_size": 4, "train_size": 64, "seed": 0}

SAMPLES: dict[str, tuple[type[IterativeTask], dict[str, Any], int]] = {
    "training": (ResNet18Training, TINY, 2),
    "training-mid-batch": (ResNet18Training, {**TINY, "steps": 2, "target_ms": 2.0}, 7),  # ~100 pieces a batch
    "inference": (ResNet18Inference, {**TINY, "eval_size": 16, "fit_steps": 2}, 3),
    "graph-sgd": (GraphSGD, {}, 3),
    "pagerank": (PageRank, {"nodes": 300, "avg_degree": 6.0, "seed": 1}, 2),
    "imaging": (ImageProcessing, {}, 2),
}


def _equal(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)  # a metric not measured yet
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, type(a)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("name", list(SAMPLES))
def test_every_sample_tasks_checkpoint_loads_weights_only(name: str, tmp_path: Path) -> None:
    cls, options, steps = SAMPLES[name]
    task = cls(**options)
    gate = UnboundedGate() if "mid-batch" in name else None
    asyncio.run(run_alone(task, steps=steps, ctx=cpu_context(tmp_path), gate=gate))
    path = tmp_path / "task.pt"
    assert _save_checkpoint(task, path, steps=steps) >= 0  # saved (-1: no state)
    saved = load_checkpoint(path)
    assert saved["steps"] == steps and _equal(task.state_dict(), saved["state"])
    assert _restore(cls(**options), _read_checkpoint(path)) == steps


class _NumpyState(IterativeTask):
    """A user's task whose state holds numpy arrays and scalars and every kind of RNG state."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {
            "weights": np.arange(6, dtype=np.float32).reshape(2, 3),
            "counts": np.array([1, 2], dtype=np.int64),
            "mask": np.array([True, False]),
            "scale": np.float64(0.5),
            "numpy_rng": np.random.RandomState(3).get_state(),
            "generator": np.random.default_rng(4).bit_generator.state,
            "python_rng": random.Random(5).getstate(),
            "torch_rng": torch.get_rng_state(),
            "note": "text",
            "history": [1.0, 2.0],
        }

    def step(self) -> None:  # never run here
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


def test_numpy_arrays_scalars_and_rng_states_round_trip(tmp_path: Path) -> None:
    task = _NumpyState()
    path = tmp_path / "np.pt"
    assert _save_checkpoint(task, path, steps=9) >= 0
    other = _NumpyState()
    other.state = {}
    assert _restore(other, _read_checkpoint(path)) == 9
    assert _equal(task.state, other.state)
    restored = np.random.RandomState()
    restored.set_state(other.state["numpy_rng"])
    assert restored.randint(1000) == np.random.RandomState(3).randint(1000)


class _Planted:
    """What an attacker pickles: unpickling it runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_a_planted_pickle_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "planted.pt"
    torch.save({"steps": 1, "state": {"x": _Planted(marker)}}, path)
    with pytest.raises(UnsafeCheckpoint, match=r"planted.pt holds types a checkpoint may not .*posix.system") as err:
        load_checkpoint(path)
    assert "\n" not in str(err.value)
    assert not marker.exists()


def test_a_file_that_is_no_worker_checkpoint_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.pt"
    torch.save([1, 2, 3], path)
    with pytest.raises(UnsafeCheckpoint, match="not a FreeRide worker checkpoint"):
        load_checkpoint(path)
