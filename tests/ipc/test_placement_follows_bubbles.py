"""Placement follows the bubbles: two stand-in ranks, a real manager, real workers.

The ranks are this test, through the real event socket: each says hello as a
rank of a two-stage job that was not pinned (every core is its own), then
reports training steps whose bubble share it chooses: stage 0 idles 0.5 % of
its step, stage 1 77 %, as in the job that showed the first task landing on
the wrong stage and running one step in the whole run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import running_manager, wait_until

from freeride import protocol as p
from freeride.serve.config import ServeConfig
from freeride.serve.manager import Manager
from freeride.transport import Endpoints, EventEmitter

MS = 1_000_000
S = 1_000_000_000
ALL_CORES = sorted(os.sched_getaffinity(0))
SHARES = {0: 0.005, 1: 0.77}
"""Bubble share of each stage's steps."""


def _config(runtime_dir: Path, *, settle_s: float, move_every_s: float = 60.0) -> ServeConfig:
    return ServeConfig(
        endpoints=Endpoints.ipc(runtime_dir),
        state_dir=runtime_dir / "state",
        checkpoint_every_s=3600,
        stop_timeout_s=10,
        settle_s=settle_s,
        move_every_s=move_every_s,
    )


@pytest.fixture
def emitter(runtime_dir: Path) -> Iterator[EventEmitter]:
    em = EventEmitter(Endpoints.ipc(runtime_dir).events)
    yield em
    em.close()


async def _hello(manager: Manager, emitter: EventEmitter, stage: int) -> None:
    hello = p.Hello(
        protocol_version=p.PROTOCOL_VERSION,
        rank=stage,
        stage=stage,
        num_stages=2,
        device=f"cpu:{stage}",
        framework="test",
        pid=os.getpid(),
        cpu_affinity=ALL_CORES,  # an unpinned rank
    )
    await wait_until(lambda: emitter.emit(hello) and manager.devices.get(hello.device) is not None, 10, "the hello")
    await wait_until(lambda: manager.devices[hello.device].alive, 10, f"stage {stage} alive")


def _steps(emitter: EventEmitter, stage: int, n: int = 2) -> None:
    """``n`` one-second training steps of ``stage``, with its bubble share (the first is warm-up)."""
    for step in range(n):
        emitter.emit(
            p.StepFinished(
                rank=stage,
                stage=stage,
                step=step,
                t_ns=time.monotonic_ns(),
                duration_ns=S,
                bubble_ns=int(SHARES[stage] * S),
            )
        )


def _setups(where: Path) -> list[dict[str, object]]:
    """One record per worker: its setup's line, amended by what its restore wrote (same pid)."""
    records: list[dict[str, object]] = []
    for line in where.read_text().splitlines() if where.exists() else []:
        entry = json.loads(line)
        if records and records[-1]["pid"] == entry["pid"]:
            records[-1].update(entry)
        else:
            records.append(entry)
    return records


async def test_a_task_submitted_before_training_lands_on_the_stage_with_the_bubbles(
    runtime_dir: Path, emitter: EventEmitter, tmp_path: Path
) -> None:
    where = tmp_path / "where.jsonl"
    async with running_manager(_config(runtime_dir, settle_s=120)) as manager:
        reply = manager.submit(p.IterativeSpec(target="_placing_tasks:WhereAmI", options={"where": str(where)}))
        assert isinstance(reply, p.Submitted) and reply.device == ""
        [task] = manager.status().tasks
        assert task.state == "pending" and "training rank" in task.pending_reason

        await _hello(manager, emitter, 0)
        record = manager.tasks[reply.task_id]
        assert record.state == "pending" and "stage(s) 1 of 2" in manager.status().tasks[0].pending_reason
        await _hello(manager, emitter, 1)
        assert record.state == "pending" and "first training steps" in manager.status().tasks[0].pending_reason

        _steps(emitter, 0)
        _steps(emitter, 1)
        await wait_until(lambda: record.state == "running", 60, "the task placed and set up")
        assert record.device == "cpu:1" and record.pending_reason == ""

        # the rank was unpinned: its side task gets the core of stage 1's position, and one thread
        [setup] = _setups(where)
        assert setup["device"] == "cpu:1" and setup["cores"] == [ALL_CORES[1 % len(ALL_CORES)]]
        assert setup["omp"] == "1"
        if importlib.util.find_spec("torch") is not None:
            assert setup["threads"] == 1


async def test_a_task_moves_to_a_stage_with_more_bubbles_from_its_checkpoint(
    runtime_dir: Path, emitter: EventEmitter, tmp_path: Path
) -> None:
    where = tmp_path / "where.jsonl"
    async with running_manager(_config(runtime_dir, settle_s=0, move_every_s=0)) as manager:
        await _hello(manager, emitter, 0)  # the only stage known: the task goes there
        reply = manager.submit(
            p.IterativeSpec(target="_placing_tasks:WhereAmI", options={"where": str(where), "step_ms": 2.0})
        )
        assert isinstance(reply, p.Submitted) and reply.device == "cpu:0"
        record = manager.tasks[reply.task_id]
        await wait_until(lambda: record.state == "running", 60, "the task set up on cpu:0")

        # a bubble on stage 0 gives it some steps to carry over (reported when its grant ends, at the deadline)
        t0 = time.monotonic_ns()
        emitter.emit(p.BubbleStarted(rank=0, stage=0, device="cpu:0", step=0, index=0, t_ns=t0, expected_ns=S // 2))
        await wait_until(lambda: record.steps >= 1, 30, "steps in the bubble")
        t1 = time.monotonic_ns()
        emitter.emit(p.BubbleEnded(rank=0, stage=0, device="cpu:0", step=0, index=0, t_ns=t1, duration_ns=t1 - t0))
        _steps(emitter, 0)
        await wait_until(lambda: manager.schedulers["cpu:0"].bubble_ns > 0, 10, "the bubble's end")
        done_on_cpu0 = record.steps

        # the other stage reports, and shows bubbles: the task moves there
        await _hello(manager, emitter, 1)
        _steps(emitter, 1)
        await wait_until(lambda: record.moves == 1 and record.state == "running", 60, "the move")
        assert (record.device, record.restarts, record.error) == ("cpu:1", 0, "")
        first, second = _setups(where)
        assert first["device"] == "cpu:0" and first["restored"] == 0
        assert second["device"] == "cpu:1" and second["pid"] != first["pid"]
        assert isinstance(second["restored"], int) and second["restored"] >= max(1, done_on_cpu0)  # it came along
        assert second["restored"] == record.checkpointed_steps
        status = manager.status().tasks[0]
        assert status.moves == 1 and status.device == "cpu:1"
        assert record not in manager.schedulers["cpu:0"].tasks and record in manager.schedulers["cpu:1"].tasks

        # and it runs on from there
        before = record.steps
        t0 = time.monotonic_ns()
        emitter.emit(p.BubbleStarted(rank=1, stage=1, device="cpu:1", step=0, index=0, t_ns=t0, expected_ns=S // 2))
        await wait_until(lambda: record.steps > before, 30, "steps on cpu:1")
        t1 = time.monotonic_ns()
        emitter.emit(p.BubbleEnded(rank=1, stage=1, device="cpu:1", step=0, index=0, t_ns=t1, duration_ns=t1 - t0))

        # the move does not come back: the gain the other way is far below 1.5x
        assert manager.tasks[reply.task_id].moves == 1
