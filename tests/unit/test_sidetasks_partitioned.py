"""The samples built on the partitioner: they train, and resume exactly from a checkpoint taken mid-batch."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from _torchfix import deterministic_one_thread  # noqa: F401 - autouse fixture

import freeride.partition.plan as plan_module
from freeride.partition import PartitionedTraining
from freeride.partition.graph import Atom, NodeGraph
from freeride.sidetask import TaskContext
from freeride.sidetasks.mobilenet import MobileNetV2Training
from freeride.sidetasks.transformer_lm import TransformerLMTraining, generated_corpus

SMALL: dict[str, tuple[type[PartitionedTraining], dict[str, Any]]] = {
    "transformer-lm": (
        TransformerLMTraining,
        {"batch_size": 2, "context": 16, "d_model": 16, "layers": 1, "heads": 2, "sentences": 50},
    ),
    "mobilenet-train": (MobileNetV2Training, {"batch_size": 4, "image_size": 32, "width": 0.25, "train_size": 32}),
}


def _virtual_profile(graph: NodeGraph, atoms: list[Atom], *args: object) -> tuple[list[float], list[float]]:
    """Piece times from parameter counts: every instance plans the same pieces.

    Both samples are chaotic at their start (a 1e-7 change to MobileNetV2's first weights moves its
    parameters by 0.3 two batches later; AdamW turns the noise in the attention's key-bias gradient, zero
    in theory, into full-size steps), so runs compare exactly only when they compute in the same pieces.
    """
    forward = []
    for atom in atoms:
        module = graph.module(atom.start)
        params = 0 if module is None else sum(p.numel() for p in module.parameters())
        forward.append(1e-5 + params * 1e-7 / atom.parts)
    return forward, [2 * f for f in forward]


@pytest.fixture(autouse=True)
def _same_plan_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_module, "_profile", _virtual_profile)


def _task(name: str) -> PartitionedTraining:
    cls, options = SMALL[name]
    return cls(**options, target_ms=0.2, profile_runs=1)


def _ctx() -> TaskContext:
    return TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=Path("."))


def _run(task: PartitionedTraining, batches: int) -> None:
    while task.batches_done < batches:
        task.step()


@pytest.mark.parametrize("name", sorted(SMALL))
def test_sample_resumes_mid_batch_exactly(name: str) -> None:
    whole = _task(name)
    asyncio.run(whole.setup(_ctx()))
    _run(whole, 3)
    assert whole.metrics()["loss"] > 0 and whole.metrics()["steps_per_batch"] > 3

    first = _task(name)
    asyncio.run(first.setup(_ctx()))
    _run(first, 1)
    for _ in range(3):  # into batch 1's forward pass
        first.step()
    state = first.state_dict()
    second = _task(name)
    second.load_state_dict(state)  # before setup, as the worker does; the data resumes without replay
    asyncio.run(second.setup(_ctx()))
    _run(second, 3)
    for (key, a), b in zip(whole.model.state_dict().items(), second.model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


def test_lm_options_are_checked() -> None:
    with pytest.raises(ValueError, match="multiple of heads"):
        TransformerLMTraining(d_model=30, heads=4)
    with pytest.raises(ValueError, match="context"):
        TransformerLMTraining(context=0)


def test_generated_corpus_is_seeded_text() -> None:
    text = generated_corpus(20, seed=3)
    assert text == generated_corpus(20, seed=3) != generated_corpus(20, seed=4)
    assert text.count(b"\n") == 19 and text.decode().isascii()
