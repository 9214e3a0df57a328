"""The partitioned transformer LM sample, run by a real manager inside a simulated pipeline's bubbles.

The task runs in its own worker process on stage 1's device while the
simulated stages (real processes, sleeping compute) produce bubbles. Its
pieces must start only inside bubbles, several must fit in one bubble, and
whole batches (forward, backward and update pieces) must complete there. The
manager checkpoints it every 0.2 s, so states taken mid-batch are written
(and the final one, at cancel, must load with weights only).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from conftest import HERE, wait_until

from freeride import protocol as p
from freeride.backends.sim import SimConfig, SimPipeline
from freeride.observe.base import Observer
from freeride.serve.manager import Manager
from freeride.tasks.targets import catalog
from freeride.worker.checkpoint import load_checkpoint

STAGE = 1
ROOT = HERE.parents[1]
OPTIONS = {"batch_size": 4, "context": 32, "d_model": 32, "layers": 2, "heads": 2, "target_ms": 0.5, "profile_runs": 1}


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


@pytest.fixture(autouse=True)
def _this_checkout_importable(_tasks_importable: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker imports the samples of this checkout, not those of wherever the package was installed from."""
    monkeypatch.setenv("PYTHONPATH", f"{HERE}{os.pathsep}{ROOT}")


async def test_transformer_lm_trains_in_pieces_inside_bubbles(manager: Manager) -> None:
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
    spec = p.IterativeSpec(target=catalog()["transformer-lm"], device=device, options=OPTIONS)
    reply = manager.submit(spec)
    assert isinstance(reply, p.Submitted), reply
    await wait_until(lambda: all(t.state == "running" for t in manager.tasks.values()), 120, "transformer-lm set up")

    sim = SimPipeline(sim_config).start()
    try:
        await asyncio.to_thread(sim.join, 180)
    finally:
        sim.terminate()
    await wait_until(lambda: not manager.live_backends(), 10, "goodbyes")
    task = next(iter(manager.tasks.values()))
    assert task.state == "running", f"{task.state} {task.error}"
    assert isinstance(await manager.cancel(task.task_id), p.Cancelled)

    assert seen.bubbles and seen.grants, f"{len(seen.bubbles)} bubbles, {len(seen.grants)} grants used"
    for done in seen.grants:
        inside = [(b, e) for b, e in seen.bubbles if b <= done.first_step_ns < e]
        assert inside, f"grant {done.grant_id} started its first step outside every bubble"
    assert max(done.steps for done in seen.grants) >= 3, "no bubble held several pieces"
    assert task.metrics.get("batches", 0) >= 2, task.metrics  # whole batches: forward, backward, update
    assert task.metrics["steps_per_batch"] > 3
    saved = load_checkpoint(Path(task.checkpoint_path))
    assert saved["state"]["batches"] >= 2
