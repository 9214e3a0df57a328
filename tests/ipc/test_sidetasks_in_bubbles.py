"""Every packaged workload, run by the manager in a simulated pipeline's bubbles.

Each workload runs in its own worker process on stage 1's device while the
simulated stages (real processes, sleeping compute) produce bubbles. Every
grant the task used must have started its first step inside a bubble of that
device, no earlier than the bubble's start and before its expected end, and
the task must make progress there.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from _quiet import OtherWork, require_quiet
from conftest import NO_BUDGET, running_manager, wait_until

from freeride import protocol as p
from freeride.backends.sim import SimConfig, SimPipeline
from freeride.observe.base import Observer
from freeride.serve.config import ServeConfig
from freeride.serve.manager import Manager
from freeride.tasks.targets import catalog
from freeride.transport import Endpoints

STAGE = 1

WORKLOADS: dict[str, dict[str, Any]] = {
    # Slow to converge: on the default graph its ranks stop changing after ~100 iterations, one step's
    # worth now that a step joins as many iterations as fit 5 ms; on this one after ~8700, ~20 grants.
    "pagerank": {"nodes": 2000, "avg_degree": 20.0, "skew": 0.3, "alpha": 0.9999, "tol": 1e-300, "max_iters": 10**8},
    "graph-sgd": {},
    "imaging": {"batch_size": 2, "image_size": 32},
    "resnet18-train": {"image_size": 16, "batch_size": 4, "target_ms": 2.0},
    "resnet50-train": {"image_size": 16, "batch_size": 4, "target_ms": 2.0},
    "vgg19-train": {"batch_size": 1, "target_ms": 5.0},
}
SLOW = {"resnet50-train", "vgg19-train"}
"""Full-size vision models: minutes of CPU training each, so only in runs that take slow tests."""


@pytest.fixture
async def manager(runtime_dir: Path) -> AsyncIterator[Manager]:
    """A manager that checkpoints at the product's default period, so the bubbles go to the task's steps.

    The other tests' manager checkpoints every 0.2 s; VGG-19's state (weights and momentum, 1.1 GB)
    then takes most bubbles of a run to copy, one slice a bubble, and its step count says nothing
    of the workload.
    """
    endpoints, state_dir = Endpoints.ipc(runtime_dir), runtime_dir / "state"
    config = ServeConfig(endpoints=endpoints, state_dir=state_dir, stop_timeout_s=5, slowdown_budget=NO_BUDGET)
    async with running_manager(config) as mgr:
        yield mgr


class _Seen(Observer):
    """Observer: the device's bubbles as announced, and the grants its side task used."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.bubbles: list[tuple[int, int]] = []
        self.grants: list[p.GrantDone] = []

    def backend_event(self, event: p.BackendEvent) -> None:
        if isinstance(event, p.BubbleStarted) and event.device == self.device:
            self.bubbles.append((event.t_ns, event.t_ns + event.expected_ns))

    def grant_done(self, device: str, task_id: int, task_name: str, done: p.GrantDone) -> None:
        if device == self.device and done.steps > 0:
            self.grants.append(done)

    def task_status(self, status: p.TaskStatus) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.slow if name in SLOW else ()) for name in sorted(WORKLOADS)]
)
async def test_workload_runs_only_inside_bubbles(manager: Manager, name: str) -> None:
    sim_config = SimConfig(
        endpoint=manager.config.endpoints.events,
        num_stages=2,
        num_microbatches=4,
        forward_s=0.015,
        backward_s=0.030,
        steps=20,
    )
    devices = [sim_config.device(stage) for stage in range(2)]
    for stage, device in enumerate(devices):
        manager.declare_device(device, stage=stage, spare_memory=8 << 30, cpu_affinity=[sim_config.core(stage)])
    device = devices[STAGE]
    seen = _Seen(device)
    manager.observers.add(seen)
    spec = p.IterativeSpec(target=catalog()[name], device=device, options=WORKLOADS[name])
    reply = manager.submit(spec)
    assert isinstance(reply, p.Submitted), reply
    await wait_until(lambda: all(t.state == "running" for t in manager.tasks.values()), 120, f"{name} set up")

    load = OtherWork()
    sim = SimPipeline(sim_config).start()
    try:
        await asyncio.to_thread(sim.join, 180)
    finally:
        sim.terminate()
    await wait_until(lambda: not manager.live_backends(), 10, "goodbyes")
    task = next(iter(manager.tasks.values()))
    assert task.state in ("running", "finished"), f"{name}: {task.state} {task.error}"
    steps = task.steps
    if task.state == "running":
        assert isinstance(await manager.cancel(task.task_id), p.Cancelled)

    assert seen.bubbles and seen.grants, f"{name}: {len(seen.bubbles)} bubbles, {len(seen.grants)} grants used"
    for done in seen.grants:
        start = done.first_step_ns
        inside = [(b, e) for b, e in seen.bubbles if b <= start < e]
        assert inside, f"{name}: grant {done.grant_id} started its first step outside every bubble"
    # at the lowest priority, a side task gets little of a core that other work keeps busy
    require_quiet(load.share(), f"{name} beside the simulated pipeline")
    assert steps >= 20, f"{name}: only {steps} steps"
