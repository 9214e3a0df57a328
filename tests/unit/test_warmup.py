"""The worker's warm-up: each step kind rehearsed before training starts, then undone by a restore."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from _sidetaskfix import cpu_context, deterministic_one_thread  # noqa: F401 - autouse fixture

from freeride.partition import plan as plan_module
from freeride.sidetask import IterativeTask, StepEstimates, TaskStopped, UnboundedGate, run_alone
from freeride.sidetasks.vision import ResNet18Training
from freeride.worker.warmup import RUNS_PER_KIND, WarmUp, warm_up


class Phases(IterativeTask):
    """Three kinds in turn; its state is its position and a running sum."""

    def __init__(self) -> None:
        self.position = 0
        self.total = torch.zeros(3)

    def step_kind(self) -> str:
        return ("a", "b", "c")[self.position % 3]

    def step(self) -> None:
        self.total[self.position % 3] += 1  # in place: a restore must undo it from a copy
        self.position += 1

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position, self.total = int(state["position"]), state["total"]


async def test_every_kind_is_rehearsed_measured_and_undone() -> None:
    task = Phases()
    task.position = 4
    record = await warm_up(task)
    assert record is not None
    assert record.seen == {"a": RUNS_PER_KIND, "b": RUNS_PER_KIND, "c": RUNS_PER_KIND}
    # each kind's first run pays its one-time costs and is not measured
    assert sorted(kind for kind, _ in record.measured) == sorted(["a", "b", "c"] * (RUNS_PER_KIND - 1))
    assert all(took > 0 for _, took in record.measured)
    estimates = StepEstimates()
    record.seed(estimates)
    assert estimates.recent() == {k: [t for kk, t in record.measured if kk == k] for k in "abc"}
    assert task.position == 4 and torch.equal(task.total, torch.zeros(3))


def test_one_slow_rehearsal_run_does_not_set_the_estimate() -> None:
    # rehearsed while the training job started beside it, a 3 ms VGG-19 piece once took 42 ms: seeded alone,
    # that kept the task out of the next 19 bubbles
    record = WarmUp(max_steps=10, max_ns=10**9)
    record.measured = [("u", 3_000_000), ("u", 42_000_000), ("f", 5_000_000), ("f", 5_200_000)]
    estimates = StepEstimates()
    record.seed(estimates)
    record.close()
    assert estimates.estimate_ns("u") == 3_000_000 and estimates.estimate_ns("f") == 5_000_000
    estimates.observe("u", 3_100_000)  # as the gate then measures it: the estimator's own rule goes on
    assert estimates.estimate_ns("u") == 3_100_000


async def test_the_step_limit_bounds_a_warm_up() -> None:
    task = Phases()
    record = await warm_up(task, max_steps=2)
    assert record is not None and record.steps == 2 and task.position == 0


async def test_a_task_without_state_or_that_opts_out_is_not_warmed_up() -> None:
    class Stateless(IterativeTask):
        def step(self) -> None:
            raise AssertionError("a step that could not be undone ran")

    class OptsOut(Phases):
        warm_up = False

        def step(self) -> None:
            raise AssertionError("a task that opted out ran a step")

    assert await warm_up(Stateless()) is None
    assert await warm_up(OptsOut()) is None


class BatchesGate(UnboundedGate):
    """Stops a task once it has finished ``batches`` whole batches, however its timed plan cut them."""

    def __init__(self, task: ResNet18Training, batches: int) -> None:
        super().__init__()
        self.task, self.batches = task, batches

    @asynccontextmanager
    async def step(self, kind: str = "") -> AsyncIterator[None]:
        if self.task.batches_done >= self.batches:
            raise TaskStopped(f"finished {self.batches} batches")
        async with super().step(kind):
            yield


async def test_a_warmed_up_resnet_trains_exactly_as_one_that_was_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every piece timed at 0.1 ms by a counting clock: the same pieces in both tasks whatever this machine's
    # timing (a slow node is opened and a wide layer split by its measured time, and other pieces sum gradients
    # in another order, which batch norm over 1x1 maps amplifies to several % in 4 batches).
    monkeypatch.setattr(plan_module, "timer", lambda device: itertools.count(0.0, 1e-4).__next__)
    opts: dict[str, Any] = {"batch_size": 4, "image_size": 16, "target_ms": 0.5, "train_size": 64, "seed": 3}
    plain = ResNet18Training(**opts)
    await run_alone(plain, steps=10_000, ctx=cpu_context(tmp_path), gate=BatchesGate(plain, 4))
    warmed = ResNet18Training(**opts)
    await warmed.setup(cpu_context(tmp_path))
    record = await warm_up(warmed)
    assert record is not None and len(record.seen) > 3  # forward, backward and update pieces
    await run_alone(warmed, steps=10_000, ctx=cpu_context(tmp_path), gate=BatchesGate(warmed, 4))
    assert warmed.metrics()["samples"] == plain.metrics()["samples"] == 16
    assert warmed.loss == plain.loss
    for (name, a), b in zip(plain.model.state_dict().items(), warmed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # batch-norm statistics too: the rehearsal's forward pieces are undone


async def test_a_rehearsal_ends_where_the_task_waits_for_its_input() -> None:
    class Consumer(Phases):
        async def run(self, gate: Any) -> None:
            async with gate.step(self.step_kind()):
                self.step()
            await gate.wait_for(asyncio.sleep(3600))  # nothing arrives before training starts
            raise AssertionError("the rehearsal waited for input")

    task = Consumer()
    record = await warm_up(task)
    assert record is not None and record.steps == 1 and task.position == 0
