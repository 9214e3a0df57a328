"""Estimate pi in bubbles: the smallest complete iterative side task.

Alone, steps back to back:  python docs/examples/pi_estimate.py
In bubbles:                 freeride submit docs/examples/pi_estimate.py:PiEstimate --opt batch=50000
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from freeride import IterativeTask, TaskContext
from freeride.sidetask import run_alone


class PiEstimate(IterativeTask):
    step_time = 0.002  # seconds: a hint until steps are measured
    peak_memory = 64 << 20  # bytes of device memory at most: placement fits it
    device_kind = "any"  # "gpu": never placed on a CPU device

    def __init__(self, *, batch: int = 100_000, seed: int = 0) -> None:
        self.batch, self.seed = batch, seed  # options: plain scalars, checked at submit
        self.hits = self.total = 0

    async def setup(self, ctx: TaskContext) -> None:
        self.device = ctx.torch_device  # "cuda:N" or "cpu": allocate here, not in __init__
        self.rng = torch.Generator(device=self.device).manual_seed(self.seed)

    def step(self) -> None:
        xy = torch.rand(self.batch, 2, device=self.device, generator=self.rng)
        self.hits += int((xy.square().sum(1) <= 1).sum())
        self.total += self.batch

    def metrics(self) -> dict[str, float]:  # shown by `freeride status`
        return {"pi": 4 * self.hits / max(self.total, 1)}

    def state_dict(self) -> dict[str, Any]:  # checkpointed between steps
        return {"hits": self.hits, "total": self.total, "rng": self.rng.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # after setup
        self.hits, self.total = int(state["hits"]), int(state["total"])
        self.rng.set_state(state["rng"])


async def main() -> None:
    task = PiEstimate(batch=10_000)
    durations = await run_alone(task, steps=200)
    print(f"pi ~ {task.metrics()['pi']:.4f} after {len(durations)} steps")


if __name__ == "__main__":
    asyncio.run(main())
