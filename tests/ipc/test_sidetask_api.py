"""The side-task API against a real manager, workers and a simulated pipeline.

A task that awaits its own input between steps (a spool directory) stays in
the lifecycle: it gives its bubbles back while it waits, and a cancel while it
waits checkpoints it instead of killing it, so nothing it did is done twice
when it is submitted again. Bad submissions fail fast, with the reason in the
submit output.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import running_manager, wait_until

from freeride import protocol as p
from freeride.backends.sim import SimConfig, SimPipeline
from freeride.serve.config import ServeConfig
from freeride.serve.manager import Manager
from freeride.serve.tasks import TaskRecord
from freeride.transport import Endpoints


@pytest.fixture
async def quiet_manager(runtime_dir: Path) -> AsyncIterator[Manager]:
    """A manager that checkpoints only when a task stops: what a cancel saves is all that is saved."""
    config = ServeConfig(
        endpoints=Endpoints.ipc(runtime_dir), state_dir=runtime_dir / "state", checkpoint_every_s=3600, stop_timeout_s=5
    )
    async with running_manager(config) as mgr:
        yield mgr


@contextlib.asynccontextmanager
async def pipeline(manager: Manager) -> AsyncIterator[str]:
    """A simulated two-stage pipeline training until the block ends; yields stage 0's device."""
    config = SimConfig(endpoint=manager.config.endpoints.events, steps=100_000, forward_s=0.005, backward_s=0.010)
    sim = SimPipeline(config).start()
    try:
        yield config.device(0)
    finally:
        sim.terminate()


def spool_spec(spool: Path, log: Path, device: str) -> p.TaskSpec:
    return p.IterativeSpec(
        target="_api_tasks:SpoolConsumer",
        device=device,
        name="spool",
        options={"spool": str(spool), "log": str(log)},
    )


def feed(spool: Path, first: int, count: int) -> None:
    for i in range(first, first + count):
        tmp = spool / f".{i:04d}"
        tmp.write_text("x")
        tmp.rename(spool / f"{i:04d}")


# Race pinned: the cancel arrives while the task awaits its own queue, outside any step.
# Before the gate could wait, the worker never read the Stop, was killed at the stop timeout
# and lost every item since its last checkpoint; submitted again, it processed them twice.
async def test_a_task_waiting_for_input_gives_bubbles_back_and_is_checkpointed_when_cancelled(
    quiet_manager: Manager, tmp_path: Path
) -> None:
    manager = quiet_manager
    spool, log = tmp_path / "spool", tmp_path / "processed.log"
    spool.mkdir()
    reasons: list[tuple[int, str]] = []
    report = manager.supervisor.report

    def recording(task: TaskRecord, done: p.GrantDone) -> None:
        reasons.append((task.task_id, done.reason))
        report(task, done)

    manager.supervisor.report = recording  # type: ignore[method-assign]
    async with pipeline(manager) as device:
        await wait_until(lambda: device in manager.devices, 30, "the simulated ranks")
        first = manager.submit(spool_spec(spool, log, device))
        assert isinstance(first, p.Submitted)
        task = manager.tasks[first.task_id]
        feed(spool, 0, 20)
        await wait_until(lambda: task.steps == 20, 60, "the first 20 items")
        await wait_until(lambda: (first.task_id, "idle") in reasons, 30, "a bubble given back while idle")
        await wait_until(lambda: manager.status().tasks[0].waiting, 30, "status showing the wait")
        # reported between checkpoints, and kept fresh while it waits
        await wait_until(lambda: manager.status().tasks[0].metrics.get("done") == 20, 30, "the metric reported")

        assert isinstance(await manager.cancel(first.task_id), p.Cancelled)
        assert task.state == "cancelled"
        assert task.checkpointed_steps == 20  # saved at the stop, not killed
        logs = (manager.config.log_dir).glob(f"task-{first.task_id}*")
        assert any("stopped (cancelled) at step 20" in f.read_text() for f in logs)

        second = manager.submit(spool_spec(spool, log, device))
        assert isinstance(second, p.Submitted)
        again = manager.tasks[second.task_id]
        await wait_until(lambda: again.state == "running", 60, "the task set up again")
        assert again.steps == 20  # its checkpoint loaded after setup built its state
        feed(spool, 20, 5)
        await wait_until(lambda: again.steps == 25, 60, "the new items")
        await manager.cancel(second.task_id)
    processed = log.read_text().split()
    assert sorted(processed) == [f"{i:04d}" for i in range(25)]  # each item exactly once


async def test_a_setup_error_fails_the_task_at_once_and_shows_in_the_submit_output(
    quiet_manager: Manager, runtime_dir: Path
) -> None:
    manager = quiet_manager
    manager.declare_device("cpu:0", stage=0, spare_memory=1 << 30, cpu_affinity=[0])
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "freeride.cli",
        "submit",
        "--runtime-dir",
        str(runtime_dir),
        "_api_tasks:FailsInSetup",
        "--opt",
        "size=3",
        "--wait",
        "60",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(90):
        out, err = await proc.communicate()
    text = out.decode()
    assert proc.returncode == 1, (text, err.decode())
    assert "failed: RuntimeError: cannot build a model of size 3" in text
    assert "in setup" in text  # the traceback's last lines
    (task,) = manager.tasks.values()
    assert task.state == "failed" and task.restarts == 0
    status = manager.status().tasks[0]
    assert "raise RuntimeError" in status.traceback


async def test_bad_options_are_refused_by_the_client_before_anything_starts(
    quiet_manager: Manager, runtime_dir: Path
) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "freeride.cli",
        "submit",
        "--runtime-dir",
        str(runtime_dir),
        "_api_tasks:FailsInSetup",
        "--opt",
        "sise=3",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(90):
        _, err = await proc.communicate()
    assert proc.returncode != 0
    assert "unknown option 'sise'" in err.decode() and "It accepts: size: int = 1" in err.decode()
    assert quiet_manager.tasks == {}
