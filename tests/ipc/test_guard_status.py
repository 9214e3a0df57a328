"""A real manager's interference guard widens its device's margin, and status over the control socket says why.

A stand-in rank (this test, through the real event socket) announces 60 ms
bubbles that end after 10 ms, and reports that it then waited 3 ms for its
core; the side task's 20 ms steps run past every end. That is far above the
0.5 % target, and every bubble ended before its deadline, so after the guard's
first stretch of bubbles it widens once: the margin doubles, the prediction
factor drops to 0.9, and the next grants carry both.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import running_manager, status, wait_until

from freeride import protocol as p
from freeride.cli.status import format_status
from freeride.serve.config import ServeConfig
from freeride.serve.guard import GuardConfig
from freeride.serve.manager import Manager
from freeride.transport import Endpoints, EventEmitter

MS = 1_000_000
DEVICE = "cpu:0"
WAITED = 3 * MS


@pytest.fixture
async def manager(runtime_dir: Path) -> AsyncIterator[Manager]:
    config = ServeConfig(
        endpoints=Endpoints.ipc(runtime_dir),
        state_dir=runtime_dir / "state",
        checkpoint_every_s=3600,
        stop_timeout_s=5,
        side_priority="same",
    )
    async with running_manager(config) as mgr:
        yield mgr


async def test_status_shows_the_guard_widening_a_margin_that_lets_side_work_spill(
    manager: Manager, runtime_dir: Path
) -> None:
    core = max(os.sched_getaffinity(0))
    manager.declare_device(DEVICE, stage=0, spare_memory=1 << 30, cpu_affinity=[core])
    reply = manager.submit(
        p.IterativeSpec(target="_tasks:SpinSteps", device=DEVICE, options={"step_ms": 20}, step_time_ns=20 * MS)
    )
    assert isinstance(reply, p.Submitted)
    task = manager.tasks[reply.task_id]
    await wait_until(lambda: task.state == "running", 60, "the task set up")
    guard = manager.schedulers[DEVICE].guard
    bubbles = guard.config.widen_after + 6  # one stretch and a little: exactly one widening
    emitter = EventEmitter(manager.config.endpoints.events)
    hello = p.Hello(
        protocol_version=p.PROTOCOL_VERSION,
        rank=0,
        stage=0,
        num_stages=2,
        device=DEVICE,
        framework="test",
        pid=os.getpid(),
        cpu_affinity=[core],
    )
    try:
        # sent until the manager knows the rank: events sent before the connection is up are dropped
        await wait_until(lambda: emitter.emit(hello) and bool(manager.live_backends()), 10, "the rank's hello")
        for index in range(bubbles):
            t0 = time.monotonic_ns()
            emitter.emit(
                p.BubbleStarted(rank=0, stage=0, device=DEVICE, step=index, index=0, t_ns=t0, expected_ns=60 * MS)
            )
            await asyncio.sleep(0.010)  # the stage waits: the bubble
            t1 = time.monotonic_ns()
            emitter.emit(
                p.BubbleEnded(
                    rank=0,
                    stage=0,
                    device=DEVICE,
                    step=index,
                    index=0,
                    t_ns=t1,
                    duration_ns=t1 - t0,
                    waited_runnable_ns=WAITED,
                )
            )
            await asyncio.sleep(0.060)  # the stage computes
        await wait_until(lambda: manager.schedulers[DEVICE].bubbles == bubbles, 10, "every bubble")
        await wait_until(lambda: guard.widenings >= 1, 10, "the guard to widen")
    finally:
        emitter.close()

    reply_status = await asyncio.to_thread(status, runtime_dir)  # over the real control socket
    [device] = [d for d in reply_status.devices if d.device == DEVICE]
    c = GuardConfig()
    assert device.margin_ns == round(manager.config.margin_ns * c.widen_by)
    assert device.prediction_factor == pytest.approx(c.widen_factor_by)
    assert device.guard_reason.startswith("widened: interference ")
    assert f"> target 0.50% over last {guard.config.widen_after} bubbles" in device.guard_reason
    assert device.guard_reason.endswith("; 100% of bubbles ended before their deadline")  # 10 ms of the 60 announced
    # the stage's wait at each end was charged (on top of the steps' compute past the ends)
    assert device.interference_ns >= guard.config.widen_after * WAITED
    # bubbles under 4 ms are left out from the start; these are 60 ms
    assert (device.min_bubble_ns, device.left_out) == (c.min_bubble_ns, 0)
    shown = (
        f"margin {device.margin_ns / 1e6:.2f} ms, bubbles predicted x{c.widen_factor_by:.2f},"
        f" bubbles under {c.min_bubble_ns / 1e6:g} ms left out (0)"
    )
    assert f"guard: {shown} ({device.guard_reason})" in format_status(reply_status, verbose=True)
