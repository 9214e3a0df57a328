"""A task's own checkpoint directory (``TaskSpec.checkpoint_dir``): how a job resumes on another node.

Two managers stand for two nodes that mount one shared directory: a task
cancelled on the first resumes on the second from the checkpoint it left there.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import msgspec
import pytest
from conftest import running_manager, wait_until

from freeride import protocol as p
from freeride.backends.sim import SimConfig, SimPipeline
from freeride.serve.config import ServeConfig
from freeride.serve.manager import Manager
from freeride.transport import Endpoints


async def _run_sim(config: SimConfig) -> None:
    sim = SimPipeline(config).start()
    try:
        await asyncio.to_thread(sim.join, 120)
    finally:
        sim.terminate()


def _sim(manager: Manager) -> SimConfig:
    config = SimConfig(endpoint=manager.config.endpoints.events, steps=30, forward_s=0.005, backward_s=0.010)
    manager.declare_device(config.device(0), stage=0, spare_memory=1 << 30, cpu_affinity=[0])
    return config


@pytest.mark.slow  # about 10 s: two managers, two simulated runs
async def test_a_task_resumes_on_another_manager_from_its_shared_checkpoint(manager: Manager, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    config = _sim(manager)
    spec = p.IterativeSpec(
        target="_tasks:SpinSteps", device=config.device(0), name="moving",
        options={"step_ms": 1.0}, checkpoint_dir=str(shared),
    )  # fmt: skip
    first = manager.submit(spec)
    assert isinstance(first, p.Submitted)
    await wait_until(lambda: manager.tasks[first.task_id].state == "running", 60, "setup")
    await _run_sim(config)
    done_before = manager.tasks[first.task_id].steps
    assert done_before > 5
    assert isinstance(await manager.cancel(first.task_id), p.Cancelled)
    assert (shared / "moving.pt").is_file() and not (manager.config.checkpoint_dir / "moving.pt").exists()

    other_dir = Path(tempfile.mkdtemp(prefix="fr-", dir="/tmp"))
    try:
        other = ServeConfig(endpoints=Endpoints.ipc(other_dir), state_dir=other_dir / "state", stop_timeout_s=5)
        async with running_manager(other) as second:
            _sim(second)
            again = second.submit(spec)
            assert isinstance(again, p.Submitted)
            await wait_until(lambda: second.tasks[again.task_id].state == "running", 60, "setup on the other node")
            assert second.tasks[again.task_id].steps == done_before
            await second.cancel(again.task_id)
    finally:
        shutil.rmtree(other_dir, ignore_errors=True)


async def test_a_checkpoint_dir_that_cannot_be_used_is_refused(manager: Manager, tmp_path: Path) -> None:
    spec = p.IterativeSpec(target="_tasks:SpinSteps", name="x")
    for bad, why in (("relative/dir", "must be an absolute path"), (str(tmp_path / "absent"), "not a directory")):
        reply = manager.submit(msgspec.structs.replace(spec, checkpoint_dir=bad))
        assert isinstance(reply, p.Rejected) and why in reply.reason, reply
