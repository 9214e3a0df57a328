"""Held-out evaluation in partitioned training gives the plain loop's losses and leaves the training as it was."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _torchfix import deterministic_one_thread  # noqa: F401 - autouse fixture
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from freeride.partition import PartitionedTraining, TrainingParts
from freeride.sidetask import TaskContext

Batches = list[tuple[Any, torch.Tensor]]
VOCAB, SEQ = 50, 8


class _Net(nn.Module):
    """Batch norm and dropout: the held-out pass differs from the training one (running statistics, no drops)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(8 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(F.relu(self.norm(self.conv(x)))).flatten(1))


def _images(n: int, seed: int) -> Batches:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, 8, 8, generator=g), torch.randint(5, (4,), generator=g)) for _ in range(n)]


def _gpt2() -> nn.Module:
    """GPT-2 from a config: dropout 0.1 everywhere, and a forward only torch.export takes (the mode baked in)."""
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0)
    return GPT2LMHeadModel(config)


def _lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), y.reshape(-1))


def _tokens(n: int, seed: int) -> Batches:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(VOCAB, (2, SEQ), generator=g), torch.randint(VOCAB, (2, SEQ), generator=g)) for _ in range(n)
    ]


Case = tuple[Callable[[], nn.Module], Callable[[Any, torch.Tensor], torch.Tensor], Callable[[int, int], Batches]]
CASES: dict[str, Case] = {"fx": (_Net, F.cross_entropy, _images), "exported": (_gpt2, _lm_loss, _tokens)}


class _Task(PartitionedTraining):
    def __init__(self, case: str, batches: int, held_out: int | None = 3, **kw: Any) -> None:
        super().__init__(target_ms=0.02, profile_runs=1, **kw)
        self.make, self.loss_fn, data = CASES[case]
        self.data = data(batches, 1)
        self.held_out = None if held_out is None else data(held_out, 2)

    def build(self) -> TrainingParts:
        torch.manual_seed(0)
        model = self.make()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return TrainingParts(model, opt, self.loss_fn, self.data, eval_data=self.held_out)


def _ctx() -> TaskContext:
    return TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=Path("."))


def _plain(case: str, batches: int, every: int) -> tuple[nn.Module, list[float]]:
    """The plain loop, evaluating after every ``every`` batches (0: never): the model and the held-out losses."""
    make, loss_fn, data = CASES[case]
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for i, (x, y) in enumerate(data(batches, 1), start=1):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
        if every and i % every == 0:
            model.eval()
            with torch.no_grad():
                held_out = [float(loss_fn(model(hx), hy)) for hx, hy in data(3, 2)]
            model.train()
            losses.append(sum(held_out) / len(held_out))
    return model, losses


def _run(task: _Task) -> list[float]:
    """Step until done; the held-out loss of each evaluation, as the metrics show it when it ends."""
    seen: list[float] = []
    while not task.done():
        task.step()
        metrics = task.metrics()
        if metrics["evaluations"] > len(seen):
            seen.append(metrics["eval_loss"])
    return seen


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_held_out_losses_are_the_plain_loops_and_the_training_is_the_same_as_without_them(case: str) -> None:
    task = _Task(case, 6, eval_every=2, steps=6)
    asyncio.run(task.setup(_ctx()))
    assert task.evaluation.plan is not None and task.plan is not None
    assert len(task.evaluation.plan.forward) > 1, "a held-out batch in one step: nothing is cut"
    assert all(s.kind.startswith("i") for s in task.evaluation.plan.forward)
    assert task.metrics()["evaluations"] == 0 and math.isnan(task.metrics()["eval_loss"])

    seen = _run(task)

    model, expected = _plain(case, 6, 2)
    assert len(seen) == 3  # after batches 2, 4 and 6: the last one before the task is done
    assert seen == pytest.approx(expected, rel=1e-5)
    _assert_same(task.model, model)
    alone, _ = _plain(case, 6, 0)
    _assert_same(task.model, alone)  # evaluating changed neither the parameters nor a random draw
    assert task.model.training


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_checkpoint_during_an_evaluation_ends_it_with_the_same_loss(case: str) -> None:
    task = _Task(case, 4, eval_every=2, steps=4)
    asyncio.run(task.setup(_ctx()))
    while task.evaluation.evaluations == 0 and not (task.evaluation.active and task.evaluation._done == 1):
        task.step()
    task.step()  # into the second held-out batch
    assert task.evaluation.active, "the checkpoint must fall inside the evaluation"
    state = task.state_dict()

    restored = _Task(case, 4, eval_every=2, steps=4)
    asyncio.run(restored.setup(_ctx()))
    restored.load_state_dict(state)
    assert restored.evaluation.active and restored.step_kind().startswith("i")
    seen = _run(restored)

    _, expected = _plain(case, 4, 2)
    assert seen == pytest.approx(expected, rel=1e-5)


def test_a_restart_takes_the_held_out_plan_back_from_the_checkpoint(caplog: pytest.LogCaptureFixture) -> None:
    task = _Task("fx", 2, eval_every=1, steps=2)
    asyncio.run(task.setup(_ctx()))
    state = task.state_dict()

    restored = _Task("fx", 2, eval_every=1, steps=2)
    caplog.set_level("INFO", logger="freeride.partition.saved")
    asyncio.run(
        restored.setup(TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=Path("."), restoring=True))
    )
    restored.load_state_dict(state)
    reused = [r.getMessage() for r in caplog.records if "plan reused" in r.getMessage()]
    assert len(reused) == 2, reused  # the training's and the held-out pass's
    assert restored.evaluation.plan is not None and task.evaluation.plan is not None
    assert [s.kind for s in restored.evaluation.plan.forward] == [s.kind for s in task.evaluation.plan.forward]


def test_evaluations_asked_without_held_out_data_or_with_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="no eval_data"):
        asyncio.run(_Task("fx", 2, held_out=None, eval_every=2).setup(_ctx()))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="eval_every must be"):
            _Task("fx", 2, eval_every=bad)
    task = _Task("fx", 2, eval_every=0)  # held-out data but no evaluations asked: none, and no metric for them
    asyncio.run(task.setup(_ctx()))
    assert task.evaluation.plan is None and "eval_loss" not in task.metrics()
