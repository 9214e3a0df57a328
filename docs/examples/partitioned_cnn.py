"""A small CNN trained as a side task, split into bubble-sized pieces by ``freeride.partition``.

Run it alone: ``python docs/examples/partitioned_cnn.py``; submit it with
``freeride submit docs/examples/partitioned_cnn.py:SmallCNNTraining`` (its steps are sized for the
bubbles of the device it lands on; ``--opt target_ms=3`` fixes them at 3 ms).
"""

from __future__ import annotations

import asyncio

import torch
from torch import nn

from freeride.partition import PartitionedTraining, TrainingParts
from freeride.sidetask import run_alone


class SmallCNNTraining(PartitionedTraining):
    """Any model, optimizer, loss and data: the partitioner times the pieces and groups them."""

    def __init__(self, *, batch: int = 16, lr: float = 0.05, target_ms: float = 0.0, steps: int = 0) -> None:
        super().__init__(target_ms=target_ms, steps=steps)
        self.batch, self.lr = batch, lr

    def build(self) -> TrainingParts:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 4),
        ).to(self.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        labels = torch.randint(0, 4, (8, self.batch), generator=g)
        # a class is a brightness level: learnable in a few passes
        images = [torch.rand(self.batch, 3, 16, 16, generator=g) * 0.5 + y[:, None, None, None] / 4 for y in labels]
        data = list(zip(images, labels, strict=True))  # re-iterable: a restore replays it to its position
        return TrainingParts(model, optimizer, nn.functional.cross_entropy, data)


async def main() -> None:
    task = SmallCNNTraining(steps=24)
    durations = await run_alone(task, steps=100_000)
    metrics = task.metrics()
    print(f"{len(durations)} steps for {metrics['batches']:.0f} batches; loss {metrics['loss']:.3f}")


if __name__ == "__main__":
    asyncio.run(main())
