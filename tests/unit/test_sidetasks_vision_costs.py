"""The vision tasks' step costs: every kind they run has one, and bigger work costs more."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from _torchfix import deterministic_one_thread  # noqa: F401 - autouse fixture

from freeride.sidetask import IterativeTask, TaskContext, UnboundedGate, run_alone
from freeride.sidetasks._cost import segment_costs
from freeride.sidetasks._models import ARCHITECTURES
from freeride.sidetasks.vision import ResNet18Inference, ResNet18Training

TINY: dict[str, Any] = {"image_size": 16, "num_classes": 4, "batch_size": 4, "train_size": 64, "seed": 0}


class _CostAtStart(UnboundedGate):
    """Records each step's kind and the cost its task gives that kind as the step starts.

    As it starts: a partitioned task groups its pieces again when their times drift (at a
    batch's end), after which an earlier grouping's kinds are no longer planned.
    """

    def __init__(self, task: IterativeTask, *, max_steps: int) -> None:
        super().__init__(max_steps=max_steps)
        self.task = task
        self.costs: dict[str, float | None] = {}

    @asynccontextmanager
    async def step(self, kind: str = "") -> AsyncIterator[None]:
        async with super().step(kind):
            self.costs[kind] = self.task.step_cost(kind)
            yield


async def _costs_run(task: IterativeTask, steps: int, tmp_path: Path) -> dict[str, float | None]:
    gate = _CostAtStart(task, max_steps=steps)
    ctx = TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=tmp_path)
    await run_alone(task, steps=steps, ctx=ctx, gate=gate)
    return gate.costs


@pytest.mark.parametrize(
    ("make", "steps"),
    [
        (lambda: ResNet18Training(**TINY), 150),  # 5 ms pieces (~50 a batch): forward, backward and update
        (lambda: ResNet18Inference(**TINY, fit_steps=1, layer_steps=True), 60),
        (lambda: ResNet18Inference(**TINY, fit_steps=1), 3),
    ],
    ids=["partitioned", "infer-layers", "infer"],
)
async def test_every_kind_a_vision_task_runs_has_a_positive_cost(
    make: Callable[[], IterativeTask], steps: int, tmp_path: Path
) -> None:
    task = make()
    costs = await _costs_run(task, steps, tmp_path)
    assert costs and all(cost is not None and cost > 0 for cost in costs.values()), costs
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
