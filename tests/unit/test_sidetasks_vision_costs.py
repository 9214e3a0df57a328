"""The vision tasks' step costs: every kind they run has one, and bigger work costs more."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _torchfix import deterministic_one_thread  # noqa: F401 - autouse fixture
from torch import nn

from freeride.sidetask import IterativeTask, TaskContext, UnboundedGate, run_alone
from sidetasks._cost import UPDATE_COST_PER_ELEMENT, segment_costs
from sidetasks._models import ARCHITECTURES
from sidetasks._staged import StagedSGD
from sidetasks.vision import ResNet18Inference, ResNet18Training

TINY: dict[str, Any] = {"image_size": 16, "num_classes": 4, "batch_size": 4, "train_size": 64, "seed": 0}


async def _kinds_run(task: IterativeTask, steps: int, tmp_path: Path) -> list[str]:
    gate = UnboundedGate()
    ctx = TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=tmp_path)
    await run_alone(task, steps=steps, ctx=ctx, gate=gate)
    return gate.kinds


@pytest.mark.parametrize(
    ("make", "steps"),
    [
        (lambda: ResNet18Training(**TINY), 2),
        (lambda: ResNet18Training(**TINY, micro_batch_size=2), 6),
        (lambda: ResNet18Training(**TINY, micro_batch_size=2, layer_steps=True), 60),
        (lambda: ResNet18Inference(**TINY, fit_steps=1, layer_steps=True), 60),
        (lambda: ResNet18Inference(**TINY, fit_steps=1), 3),
    ],
    ids=["whole", "micro", "layers", "infer-layers", "infer"],
)
async def test_every_kind_a_vision_task_runs_has_a_positive_cost(
    make: Callable[[], IterativeTask], steps: int, tmp_path: Path
) -> None:
    task = make()
    kinds = set(await _kinds_run(task, steps, tmp_path))
    costs = {kind: task.step_cost(kind) for kind in kinds}
    assert all(cost is not None and cost > 0 for cost in costs.values()), costs
    assert task.step_cost("no such kind") is None


def test_the_stem_costs_its_multiply_adds() -> None:
    forward = segment_costs("resnet18", num_classes=10, batch=2, image_size=32)
    conv = 2 * 64 * 16 * 16 * 3 * 7 * 7  # 7x7 stride 2 from 3 channels: 16x16x64 outputs per image
    elementwise = 2 * 64 * (16 * 16 * 2 + 8 * 8)  # batch norm, ReLU, then the max pool's output
    assert forward[0] == conv + elementwise


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_more_images_and_wider_layers_cost_more(arch: str) -> None:
    one = segment_costs(arch, num_classes=10, batch=1, image_size=32)
    two = segment_costs(arch, num_classes=10, batch=2, image_size=32)
    assert all(c > 0 for c in one) and [2 * c for c in one] == two
    assert segment_costs(arch, num_classes=10, batch=1, image_size=64)[0] > one[0]


def _meta_staged(arch: str, *, micro: int, layer_steps: bool) -> tuple[nn.Module, StagedSGD]:
    with torch.device("meta"):
        model = ARCHITECTURES[arch](10)
    staged = StagedSGD(
        model,
        model.segments(),  # type: ignore[operator]
        lr=0.1,
        momentum=0.9,
        weight_decay=0.0,
        micro_batch_size=micro,
        layer_steps=layer_steps,
    )
    return model, staged


@pytest.mark.parametrize("arch", ["resnet50", "vgg19"])
def test_the_large_models_cost_every_piece(arch: str) -> None:
    # On the meta device: nothing is allocated, and the pieces are what a real run would name.
    model, staged = _meta_staged(arch, micro=2, layer_steps=True)
    forward = segment_costs(arch, num_classes=10, batch=2, image_size=32)
    costs = staged.step_costs(forward)
    assert all(cost > 0 for cost in costs.values())
    n = len(forward)
    for k in range(n):
        pieces = [kind for kind in costs if kind.startswith(f"forward{k}.")] or [f"forward{k}"]
        assert sum(costs[p] for p in pieces) == pytest.approx(forward[k])
        backward = sum(costs[p.replace("forward", "backward")] for p in pieces)
        assert backward > sum(costs[p] for p in pieces)  # weight and input gradients
    params = sum(p.numel() for p in model.parameters())
    update = sum(cost for kind, cost in costs.items() if kind.startswith("update"))
    assert update == params * UPDATE_COST_PER_ELEMENT
    if arch == "vgg19":  # its first linear layer (25088 x 4096) runs in row blocks
        assert any("." in kind for kind in costs)


def test_staged_costs_name_exactly_the_kinds_it_runs() -> None:
    torch.manual_seed(0)
    segments: list[nn.Module] = [
        nn.Sequential(nn.Flatten(1)),
        nn.Sequential(nn.Linear(48, 64), nn.ReLU()),
        nn.Sequential(nn.Linear(64, 5)),
    ]
    model = nn.Sequential(*segments)
    staged = StagedSGD(
        model, segments, lr=0.1, momentum=0.9, weight_decay=0.0, micro_batch_size=2, layer_steps=True, chunk_elems=1024
    )
    costs = staged.step_costs([2 * 48.0, 2 * 48 * 64.0, 2 * 64 * 5.0])
    batch = (torch.randn(4, 3, 4, 4), torch.randint(5, (4,)))
    seen = set()
    for _ in range(3 * len(costs)):
        seen.add(staged.next_kind())
        staged.advance(lambda: batch)
    assert seen == set(costs)
    assert any("." in kind for kind in costs)  # the larger linear layer ran in row blocks
