"""Imperative side tasks through the manager: unmodified programs, frozen outside bubbles."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from conftest import wait_until

from freeride import protocol as p
from freeride.backends.sim import SimConfig, SimPipeline
from freeride.serve.manager import Manager

BUSY = [sys.executable, "-c", "while True: pass"]


async def _train(manager: Manager, steps: int) -> list[int]:
    config = SimConfig(endpoint=manager.config.endpoints.events, steps=steps, forward_s=0.005, backward_s=0.010)
    sim = SimPipeline(config).start()
    try:
        results = await asyncio.to_thread(sim.join, 120)
    finally:
        sim.terminate()
    await wait_until(lambda: not manager.live_backends(), 10, "goodbyes")
    return [len(r.step_ns) for r in results]


async def test_a_cpu_bound_program_runs_only_inside_bubbles(manager: Manager) -> None:
    manager.declare_device("cpu:0", stage=0, spare_memory=1 << 30, cpu_affinity=[0])
    reply = manager.submit(p.ProgramSpec(argv=BUSY, device="cpu:0"))
    assert isinstance(reply, p.Submitted)
    task = manager.tasks[reply.task_id]
    await wait_until(lambda: task.state == "running", 30, "the program to start (stopped)")
    assert await _train(manager, 40) == [40, 40]
    device = manager.schedulers["cpu:0"]
    assert await manager.cancel(task.task_id) == p.Cancelled(task_id=task.task_id, kind="imperative")
    await wait_until(lambda: "user_s" in task.metrics, 10, "the exit report")
    cpu_ns = (task.metrics["user_s"] + task.metrics["system_s"]) * 1e9
    assert device.bubbles >= 70
    # the manager's account of the program's compute (inside bubbles, and after their ends)
    # agrees with the program's own CPU time (its rusage): it ran only under grants
    assert device.used_ns + device.interference_ns == pytest.approx(cpu_ns, rel=0.10)
    # the program's CPU time fits in the time it was let run, which lies inside bubbles:
    # what ran past a bubble's end (overrun) stays under 1 ms per bubble
    assert cpu_ns <= task.busy_ns * 1.02 + 10e6
    assert device.overrun_ns / device.bubbles < 1e6, (device.overrun_ns, device.bubbles)


async def test_a_program_over_its_memory_cap_is_stopped_and_reported(manager: Manager, tmp_path: Path) -> None:
    hog = [sys.executable, "-c", "import time; x = bytearray(3 << 30); time.sleep(30)"]
    for stage in range(2):
        manager.declare_device(f"cpu:{stage}", stage=stage, spare_memory=2 << 30, cpu_affinity=[stage])
    bad = manager.submit(p.ProgramSpec(argv=hog, device="cpu:0", peak_memory=64 << 20, max_restarts=0))
    good = manager.submit(p.IterativeSpec(target="_tasks:SpinSteps", device="cpu:1", options={"step_ms": 1.0}))
    assert isinstance(bad, p.Submitted) and isinstance(good, p.Submitted)
    await wait_until(lambda: manager.tasks[good.task_id].state == "running", 60, "the well-behaved task")
    assert await _train(manager, 30) == [30, 30]  # training is unaffected
    hog_task = manager.tasks[bad.task_id]
    await wait_until(lambda: hog_task.state == "failed", 30, "the hog to fail")
    assert "exited with code 1" in hog_task.error
    err = next(manager.config.log_dir.glob(f"task-{bad.task_id}-*.err")).read_text()
    assert "MemoryError" in err
    assert manager.tasks[good.task_id].state == "running" and manager.tasks[good.task_id].steps > 0


async def test_an_iterative_task_over_its_memory_cap_fails_alone(manager: Manager) -> None:
    manager.declare_device("cpu:0", stage=0, spare_memory=2 << 30, cpu_affinity=[0])
    reply = manager.submit(
        p.IterativeSpec(
            target="_tasks:Hog",
            device="cpu:0",
            options={"mb": 800},
            peak_memory=64 << 20,
            max_restarts=0,
        )
    )
    assert isinstance(reply, p.Submitted)
    task = manager.tasks[reply.task_id]
    await wait_until(lambda: task.state == "running", 60, "setup")
    assert await _train(manager, 20) == [20, 20]
    await wait_until(lambda: task.state == "failed", 30, "the task to fail")
    assert task.error.startswith("MemoryError")
