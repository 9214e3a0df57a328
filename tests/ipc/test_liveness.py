"""Liveness with real workers: hung steps, cancels that do not block, bounded loss, restart backoff, memory caps.

Each test runs its own manager with short liveness settings and a simulated
pipeline for bubbles; waits are on the manager's own state (bounded), never
fixed sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from conftest import NO_BUDGET, running_manager, wait_until

from freeride import protocol as p
from freeride.backends.sim import SimConfig, SimPipeline
from freeride.observe.base import Observer
from freeride.serve.config import ServeConfig
from freeride.serve.manager import Manager
from freeride.transport import ControlClient, Endpoints

FAST: dict[str, Any] = {
    "checkpoint_every_s": 0.2,
    "stop_timeout_s": 2.0,
    "hang_after_s": 0.5,
    "restart_backoff_s": 0.05,
    "restart_backoff_max_s": 0.2,
    "slowdown_budget": NO_BUDGET,
}


@contextlib.asynccontextmanager
async def serving(runtime_dir: Path, **overrides: Any) -> AsyncIterator[Manager]:
    config = ServeConfig(endpoints=Endpoints.ipc(runtime_dir), state_dir=runtime_dir / "state", **{**FAST, **overrides})
    async with running_manager(config) as mgr:
        yield mgr


@contextlib.contextmanager
def training(manager: Manager, steps: int = 2000) -> Iterator[SimConfig]:
    """A simulated two-stage job feeding bubbles to ``cpu:0`` (and ``cpu:1``) until the block ends."""
    config = SimConfig(endpoint=manager.config.endpoints.events, steps=steps, forward_s=0.005, backward_s=0.010)
    sim = SimPipeline(config).start()
    try:
        yield config
    finally:
        sim.terminate()


def submit(manager: Manager, target: str, device: str = "cpu:0", **kw: Any) -> p.Submitted:
    options = kw.pop("options", {})
    reply = manager.submit(p.IterativeSpec(target=target, device=device, options=options, **kw))
    assert isinstance(reply, p.Submitted), reply
    return reply


def declare(manager: Manager, spare: int = 1 << 30) -> None:
    for stage in range(2):
        manager.declare_device(f"cpu:{stage}", stage=stage, spare_memory=spare, cpu_affinity=[stage])


async def test_a_hung_step_is_detected_and_restarted_while_a_healthy_task_keeps_stepping(
    runtime_dir: Path, tmp_path: Path, resumed_steps: dict[int, list[int]]
) -> None:
    marker, armed = tmp_path / "hung", tmp_path / "armed"
    async with serving(runtime_dir) as manager:
        declare(manager)
        # it hangs only once the manager has a periodic checkpoint (every 0.2 s) of some progress: a
        # hang at a fixed step came before any checkpoint on a loaded machine, and the restart began from 0
        hung = submit(
            manager,
            "_liveness_tasks:HangOnce",
            options={"step_ms": 1.0, "marker": str(marker), "hang_at": 20, "armed": str(armed)},
        )
        healthy = submit(manager, "_tasks:SpinSteps", options={"step_ms": 1.0})
        h, ok = manager.tasks[hung.task_id], manager.tasks[healthy.task_id]
        await wait_until(lambda: h.state == ok.state == "running", 60, "both tasks set up")
        with training(manager):
            await wait_until(lambda: h.checkpointed_steps > 0, 60, "a checkpoint of some progress")
            armed.touch()
            await wait_until(marker.exists, 60, "the step that hangs")
            before = ok.steps
            await wait_until(lambda: h.hangs == 1, 10, "the hang to be detected")
            saved = h.checkpointed_steps  # the hung worker saves no more
            assert "step hung" in (h.error or h.restart_reason)  # its restart may have begun
            # the healthy task had the bubbles to itself meanwhile (the hung one got no grant)
            assert ok.steps > before
            await wait_until(lambda: h.state == "running" and h.restarts == 1, 60, "the restart")
            starts = resumed_steps[h.task_id]
            assert len(starts) == 2 and starts[1] >= saved > 0, (starts, saved)  # from there, not from scratch
            resumed = h.steps
            await wait_until(lambda: h.steps > resumed + 10, 60, "the restarted task to step")
        assert ok.restarts == 0 and ok.hangs == 0


async def test_a_slow_step_is_not_hung_it_finishes_in_bubbles_and_the_task_goes_on(
    runtime_dir: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "slow"
    async with serving(runtime_dir) as manager:  # hang_after 0.5 s: the slow step lasts 4 times that
        declare(manager)
        reply = submit(
            manager,
            "_liveness_tasks:SlowOnce",
            options={"step_ms": 1.0, "slow_at": 20, "slow_s": 2.0, "marker": str(marker)},
            max_restarts=0,
        )
        task = manager.tasks[reply.task_id]
        await wait_until(lambda: task.state == "running", 60, "setup")
        with training(manager):
            await wait_until(lambda: task.slow, 60, "the slow step to be found slow")
            assert task.error.startswith("step slow:"), task.error
            await wait_until(marker.exists, 120, "the slow step to finish, in bubbles")
            steps = task.steps
            await wait_until(lambda: task.steps > steps + 10, 60, "the task to step on")
            await wait_until(lambda: task.error == "", 10, "the note to go with the step")
        wall_s, cpu_s = map(float, marker.read_text().split())
        assert task.hangs == 0 and task.restarts == 0 and task.state == "running", task.error
        # frozen between bubbles: the step took longer by the wall than the CPU time it computed
        assert wall_s > 1.3 * cpu_s, (wall_s, cpu_s)


async def test_a_task_that_hangs_again_from_the_same_state_fails_instead_of_cycling(runtime_dir: Path) -> None:
    # no periodic checkpoint: with one every 0.2 s, whether the second run saved one before its hang depended on
    # how long its four steps took (a loaded machine: three hangs, from steps 0, 3 and 3)
    async with serving(runtime_dir, checkpoint_every_s=3600.0) as manager:
        declare(manager)
        reply = submit(manager, "_liveness_tasks:AlwaysHang", options={"step_ms": 1.0, "hang_at": 5}, max_restarts=10)
        task = manager.tasks[reply.task_id]
        with training(manager):
            await wait_until(lambda: task.terminal, 90, "the task to fail")
        assert task.state == "failed" and task.hangs == 2 and task.restarts == 1, (task.hangs, task.restarts)
        assert "not restarted: it hung before, from the same state" in task.error, task.error


async def test_cancelling_a_hung_task_answers_at_once(runtime_dir: Path, tmp_path: Path) -> None:
    marker = tmp_path / "hung"
    # the detector stays out of it: only the cancel stops the task
    async with serving(runtime_dir, hang_after_s=600.0, stop_timeout_s=1.0) as manager:
        declare(manager)
        reply = submit(manager, "_liveness_tasks:HangOnce", options={"step_ms": 1.0, "marker": str(marker)})
        task = manager.tasks[reply.task_id]
        await wait_until(lambda: task.state == "running", 60, "setup")
        with training(manager):
            await wait_until(marker.exists, 60, "the step that hangs")
        endpoint = manager.config.endpoints.control

        def cancel_then_status() -> tuple[p.ControlReply, p.ControlReply]:
            with ControlClient(endpoint, timeout_s=5.0) as client:
                cancelled = client.request(p.Cancel(task_id=reply.task_id))
                return cancelled, client.request(p.StatusRequest())

        cancelled, answered = await asyncio.to_thread(cancel_then_status)
        assert cancelled == p.Cancelled(task_id=reply.task_id)
        assert isinstance(answered, p.StatusReply)
        # the worker will not checkpoint: its stop takes stop_timeout_s and more; both answers came
        # while it was still under way (a cancel that waited for the stop would answer afterwards)
        [seen] = [t for t in answered.tasks if t.task_id == reply.task_id]
        assert seen.state != "cancelled", seen
        await wait_until(lambda: task.state == "cancelled", 20, "the stop, in the background")


async def test_a_task_whose_checkpoint_fits_no_bubble_loses_at_most_the_bound_to_sigkill(
    runtime_dir: Path, tmp_path: Path
) -> None:
    count, restored = tmp_path / "count", tmp_path / "restored"
    bound = 20
    async with serving(runtime_dir, max_loss_steps=bound) as manager:
        declare(manager)
        reply = submit(
            manager,
            "_liveness_tasks:SlowCheckpoint",
            options={"step_ms": 1.0, "save_ms": 300.0, "count_file": str(count), "restored_file": str(restored)},
        )
        task = manager.tasks[reply.task_id]
        await wait_until(lambda: task.state == "running", 60, "setup")
        with training(manager):
            # a 300 ms save fits no bubble here (they last tens of ms): only forced ones happen
            await wait_until(lambda: task.checkpointed_steps >= 2 * bound, 60, "checkpoints forced by the bound")
            assert task.status().max_loss_steps == bound
            os.kill(task.pid, signal.SIGKILL)
            await wait_until(restored.exists, 60, "the restart from the checkpoint")
        lost = int(count.read_text()) - int(restored.read_text())
        assert 0 <= lost <= bound, lost


async def test_a_500_mb_state_under_20_ms_bubbles_is_never_more_than_30_s_behind_and_sigkill_loses_no_more(
    runtime_dir: Path, tmp_path: Path
) -> None:
    """Saved at once, the state would take seconds: its checkpoints are copied a slice per bubble and written
    beside the steps. Each checkpoint's age is the time since the task first reached its step count."""
    restored = tmp_path / "restored"
    async with serving(runtime_dir, checkpoint_every_s=3.0, hang_after_s=5.0) as manager:
        declare(manager, spare=4 << 30)
        reply = submit(manager, "_liveness_tasks:BigState", options={"step_ms": 1.0, "restored_file": str(restored)})
        task = manager.tasks[reply.task_id]
        await wait_until(lambda: task.state == "running", 60, "setup")
        config = SimConfig(endpoint=manager.config.endpoints.events, steps=100_000, forward_s=0.007, backward_s=0.013)
        sim = SimPipeline(config).start()  # stage 0 waits 20 ms for stage 1's forward and backward
        try:
            reached: dict[int, float] = {}  # step count -> when the manager first saw it
            ages: list[float] = []
            start = time.monotonic()
            while time.monotonic() - start < 24:
                now = time.monotonic()
                reached.setdefault(task.steps, now)
                if task.checkpointed_steps > 0:
                    ages.append(now - min(t for s, t in reached.items() if s >= task.checkpointed_steps))
                await asyncio.sleep(0.1)
            assert ages and task.checkpointed_steps > 0, "no checkpoint in 24 s of bubbles"
            first = time.monotonic() - start - len(ages) * 0.1
            saved = task.checkpointed_steps
            os.kill(task.pid, signal.SIGKILL)
            killed = time.monotonic()
            await wait_until(restored.exists, 60, "the restart from the checkpoint")
        finally:
            sim.terminate()
    count, consistent, restoring = restored.read_text().split()
    assert consistent == "True" and restoring == "True" and int(count) >= saved
    behind = killed - min(t for s, t in reached.items() if s >= int(count))
    assert first < 30 and max(ages) < 30 and behind < 30, (first, max(ages), behind)


class _Restarts(Observer):
    def __init__(self) -> None:
        self.seen: list[tuple[int, float, float]] = []

    def task_status(self, status: p.TaskStatus) -> None:
        if status.restarts and (not self.seen or self.seen[-1][0] != status.restarts):
            self.seen.append((status.restarts, status.backoff_s, time.monotonic()))


async def test_restarts_back_off_exponentially_up_to_the_bound(runtime_dir: Path) -> None:
    async with serving(runtime_dir) as manager:
        restarts = _Restarts()
        manager.observers.add(restarts)
        declare(manager)
        reply = submit(manager, "_liveness_tasks:CrashInSetup", max_restarts=4)
        task = manager.tasks[reply.task_id]
        await wait_until(lambda: task.state == "failed", 60, "the restarts to be spent")
    assert [(n, backoff) for n, backoff, _ in restarts.seen] == [(1, 0.05), (2, 0.1), (3, 0.2), (4, 0.2)]
    for (_, backoff, at), (_, _, next_at) in zip(restarts.seen, restarts.seen[1:], strict=False):
        assert next_at - at >= backoff  # each restart waited its delay (a lower bound: not timing-flaky)


async def test_a_task_without_a_declared_peak_is_still_capped_and_fails_alone(runtime_dir: Path) -> None:
    # the hog's one big allocation can take longer than FAST's 0.5 s hang threshold on a busy machine:
    # the hang detector must not kill it before the memory cap does (that is the other test's subject)
    async with serving(runtime_dir, hang_after_s=60.0) as manager:
        declare(manager, spare=256 << 20)  # what the device can spare: the cap of a task that declares none
        hog = submit(manager, "_tasks:Hog", options={"mb": 800}, max_restarts=0)
        good = submit(manager, "_tasks:SpinSteps", options={"step_ms": 1.0})
        bad, ok = manager.tasks[hog.task_id], manager.tasks[good.task_id]
        await wait_until(lambda: bad.state == ok.state == "running", 60, "setup")
        assert bad.memory_cap == 256 << 20 and bad.memory_cap_by
        with training(manager):
            await wait_until(lambda: bad.state == "failed", 30, "the hog to fail")
            steps = ok.steps
            await wait_until(lambda: ok.steps > steps, 30, "the other task to keep stepping")
        assert bad.error.startswith("MemoryError") or "memory cap" in bad.error, bad.error
        assert ok.state == "running"


async def test_a_task_that_imports_torch_after_the_cap_runs(runtime_dir: Path) -> None:
    async with serving(runtime_dir) as manager:
        declare(manager)
        reply = submit(manager, "_liveness_tasks:LateTorch", peak_memory=256 << 20, max_restarts=0)
        task = manager.tasks[reply.task_id]
        with training(manager):
            await wait_until(lambda: task.terminal, 90, "the task to finish")
        assert task.state == "finished", task.error
