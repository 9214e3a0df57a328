"""Armed grants end to end: a real rank session, a real manager and a real worker.

The rank (a :class:`~freeride.backends.session.BackendSession` in this process, over the
real event socket) also publishes its bubble starts and ends; the manager arms
the worker between bubbles, and the worker starts its steps on the rank's own
event and stops at its end. Each bubble must still be accounted for, once the
manager reads the rank's events in batches too: the grants come back, the
bubble time they used is counted, and the latency is measured from the rank's
timestamp as for a Grant.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
from conftest import running_manager, wait_until

from freeride import protocol as p
from freeride.backends.session import BackendConfig, BackendSession
from freeride.observe.base import Observer
from freeride.serve.config import ServeConfig
from freeride.serve.manager import Manager
from freeride.transport import (
    BubbleListener,
    BubblePublisher,
    Endpoints,
    EventEmitter,
    bubbles_endpoint,
    new_async_context,
    wait_readable,
)
from freeride.transport.frames import BUBBLE_END

MS = 1_000_000
DEVICE = "cpu:0"


class Reports(Observer):
    """Every grant report the manager receives."""

    def __init__(self) -> None:
        self.done: list[p.GrantDone] = []

    def grant_done(self, device: str, task_id: int, task_name: str, done: p.GrantDone) -> None:
        self.done.append(done)


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _this_checkouts_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers import this checkout's freeride (not whichever one is installed): their half is under test."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.environ["PYTHONPATH"], str(ROOT)]))


@pytest.fixture
async def manager(runtime_dir: Path) -> AsyncIterator[Manager]:
    config = ServeConfig(
        endpoints=Endpoints.ipc(runtime_dir), state_dir=runtime_dir / "state", checkpoint_every_s=3600, stop_timeout_s=5
    )
    async with running_manager(config) as mgr:
        yield mgr


def _device(manager: Manager) -> p.DeviceStatus:
    [device] = [d for d in manager.status().devices if d.device == DEVICE]
    return device


async def _one_bubble(
    manager: Manager, session: BackendSession, reports: Reports, task_id: int, step: int
) -> p.GrantDone:
    """A long bubble, ended once the task has stepped in it; its grant's report, once settled."""
    seen = len(reports.done)
    used = _device(manager).used_ns
    runner = manager.tasks[task_id].runner
    assert runner is not None
    cpu = runner.cpu_ns()
    session.bubble_started(step, 500 * MS)  # the end below comes first
    # a step spins 1 ms of CPU: the worker has stepped once its clock moved that far
    await wait_until(lambda: runner.cpu_ns() > cpu + MS or len(reports.done) > seen, 30, "a step")
    session.bubble_ended()
    # the grant comes back and what it used is counted
    await wait_until(lambda: _device(manager).used_ns > used, 30, "the grant settled after the revoke")
    return reports.done[-1]


async def test_a_worker_starts_on_the_ranks_own_bubble_start_and_is_still_revoked_and_accounted(
    manager: Manager,
) -> None:
    reports = Reports()
    manager.observers.add(reports)
    core = max(os.sched_getaffinity(0))
    manager.declare_device(DEVICE, stage=0, spare_memory=1 << 30, cpu_affinity=[core])
    reply = manager.submit(
        p.IterativeSpec(target="_tasks:SpinSteps", device=DEVICE, options={"step_ms": 1.0}, step_time_ns=MS)
    )
    assert isinstance(reply, p.Submitted)
    await wait_until(lambda: manager.tasks[reply.task_id].state == "running", 60, "the worker's setup")

    endpoint = manager.config.endpoints.events
    session = BackendSession(
        BackendConfig(endpoint=endpoint, rank=0, stage=0, num_stages=1, device=DEVICE, framework="sim")
    )
    try:

        def published() -> bool:
            session.heartbeat()  # a Hello goes out once the socket is up; then the publisher binds
            return manager.schedulers[DEVICE].bubbles_endpoint == bubbles_endpoint(endpoint, 0)

        await wait_until(published, 30, "the rank announcing its bubble publisher")
        # The worker subscribes when first armed: bubbles until a few grants were armed
        # (the first may come before its subscription is up and go by the manager's Grant).

        armed_before_end = 0
        for step in range(60):
            done = await _one_bubble(manager, session, reports, reply.task_id, step)
            assert done.reason == "revoked"  # the bubble's end revoked the grant
            armed_before_end += done.armed
            if armed_before_end >= 3:
                break
        else:
            raise AssertionError(f"no armed grant in 60 bubbles: {reports.done[-5:]}")
        # The worker hears the rank: nothing the manager decides waits on the rank's events, which it
        # now reads in batches; a bubble is still used, stopped by its end and accounted.
        await wait_until(lambda: not manager.edges_due(), 10, "the manager reading the rank's events in batches")
        done = await _one_bubble(manager, session, reports, reply.task_id, step + 1)
        assert (done.reason, done.armed) == ("revoked", True)
    finally:
        session.close()

    device = _device(manager)
    armed = [d for d in reports.done if d.armed and d.steps]
    assert device.armed_grants == len(armed) >= 3
    assert all(d.first_step_delay_ns >= 0 and d.cpu_at_start_ns >= 0 for d in armed)
    assert manager.latency.count == sum(1 for d in reports.done if d.steps)
    assert 0 < device.used_ns <= device.bubble_ns
    assert manager.tasks[reply.task_id].state == "running"


async def test_a_rank_that_names_another_publisher_is_not_followed(manager: Manager) -> None:
    # An armed worker connects where the manager tells it: only inside the manager's own
    # runtime directory, at the address the manager derives, never where a Hello says.
    emitter = EventEmitter(manager.config.endpoints.events)
    hello = p.Hello(
        protocol_version=p.PROTOCOL_VERSION,
        rank=0,
        stage=0,
        num_stages=1,
        device=DEVICE,
        framework="sim",
        pid=os.getpid(),
        bubbles_endpoint="ipc:///tmp/elsewhere/bubbles-0",
    )
    try:

        def greeted() -> bool:
            emitter.emit(hello)  # dropped until the connection is up
            return DEVICE in manager.schedulers and manager.rejected_frames > 0

        await wait_until(greeted, 30, "the manager to refuse the publisher")
        assert manager.schedulers[DEVICE].bubbles_endpoint == ""
    finally:
        emitter.close()


async def test_a_publisher_without_subscribers_never_blocks_and_a_listener_gets_the_latest(runtime_dir: Path) -> None:
    assert bubbles_endpoint("tcp://127.0.0.1:5555", 0) == ""  # remote ranks keep the two-hop path
    endpoint = bubbles_endpoint(Endpoints.ipc(runtime_dir).events, 3)
    publisher = BubblePublisher(endpoint)
    ctx = new_async_context()
    listener: BubbleListener | None = None
    try:
        assert publisher.bound
        for step in range(10_000):  # nobody listens: each is dropped at once
            publisher.publish(_started(step))
        listener = BubbleListener(ctx, endpoint)
        latest = -1
        async with asyncio.timeout(30):
            step = 10_000
            while latest < step:
                step += 1
                publisher.publish(_started(step))  # until the subscription is up
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await wait_readable(listener)
                event = listener.recv_nowait()
                if isinstance(event, p.BubbleStarted):
                    latest = event.step
        assert latest == step and publisher.dropped == 0
    finally:
        if listener is not None:
            listener.close()
        publisher.close()
        ctx.term()


def test_a_publisher_closed_right_after_its_last_bubble_end_still_delivers_it(runtime_dir: Path) -> None:
    # A rank publishes its last bubble end just before it closes; the manager must get it.
    endpoint = bubbles_endpoint(Endpoints.ipc(runtime_dir).events, 4)
    ctx = zmq.Context()
    try:
        for attempt in range(20):
            publisher = BubblePublisher(endpoint)
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            try:
                step = 0
                while not sub.poll(10):  # until the subscription is up
                    step += 1
                    publisher.publish(_started(step))
                last = p.BubbleEnded(rank=4, stage=0, device=DEVICE, step=10**6, index=0, t_ns=1, duration_ns=1)
                publisher.publish(last)
                publisher.close()
                got = []
                while sub.poll(5000):
                    frame = sub.recv()
                    got.append(frame)
                    if frame[:1] == BUBBLE_END:
                        break
                assert got and got[-1][:1] == BUBBLE_END, f"attempt {attempt}: the last bubble end was lost"
            finally:
                publisher.close()
                sub.close()
    finally:
        ctx.term()


def _started(step: int) -> p.BubbleStarted:
    return p.BubbleStarted(rank=3, stage=0, device=DEVICE, step=step, index=0, t_ns=step + 1, expected_ns=MS)
