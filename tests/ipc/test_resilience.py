"""Bad input, vanished backends and a dead manager: nothing stops the others."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from conftest import poll, status, wait_until

from freeride import protocol as p
from freeride.backends.sim import SimConfig, SimPipeline
from freeride.serve.manager import Manager
from freeride.transport import Endpoints, EventEmitter


async def test_garbage_wrong_version_and_unknown_tags_are_rejected(manager: Manager) -> None:
    ep = manager.config.endpoints
    ctx = zmq.Context()
    push, control = ctx.socket(zmq.PUSH), ctx.socket(zmq.DEALER)
    push.connect(ep.events)
    control.connect(ep.control)
    try:
        push.send(b"\xc1 not msgpack")
        push.send(msgspec.msgpack.encode({"type": "bubble_exploded", "rank": 1}))
        push.send(msgspec.msgpack.encode({"type": "heartbeat", "rank": "zero", "t_ns": 1}))
        old = p.Hello(
            protocol_version=p.PROTOCOL_VERSION + 1, rank=5, stage=0, num_stages=2, device="cpu:0", framework="x", pid=1
        )
        push.send(msgspec.msgpack.encode(old))
        await wait_until(lambda: manager.rejected_frames == 4, 10, "4 rejected frames")
        assert "cpu:0" not in manager.devices  # the wrong-version rank was not registered

        control.send(b"garbage")
        await wait_until(lambda: bool(control.poll(0)), 10, "a reply to garbage")
        reply = msgspec.msgpack.decode(control.recv(), type=p.ControlReply)
        assert isinstance(reply, p.Rejected) and "malformed" in reply.reason

        good = p.Hello(
            protocol_version=p.PROTOCOL_VERSION,
            rank=6,
            stage=1,
            num_stages=2,
            device="cpu:1",
            framework="x",
            pid=os.getpid(),
        )
        push.send(msgspec.msgpack.encode(good))
        await wait_until(lambda: "cpu:1" in manager.devices, 10, "the valid rank")
        assert manager.status().rejected_frames == 5
    finally:
        push.close(0)
        control.close(0)
        ctx.term()


async def test_a_backend_killed_mid_step_is_noticed_and_others_keep_being_served(manager: Manager) -> None:
    events = manager.config.endpoints.events
    job_a = SimConfig(endpoint=events, device_prefix="a", steps=200, forward_s=0.005, backward_s=0.010)
    job_b = SimConfig(endpoint=events, device_prefix="b", rank_offset=10, steps=60, forward_s=0.005, backward_s=0.010)
    for stage in range(2):
        manager.declare_device(job_b.device(stage), stage=stage, spare_memory=1 << 30, cpu_affinity=[job_b.core(stage)])
        manager.submit(p.IterativeSpec(target="_tasks:SpinSteps", device=job_b.device(stage), options={"step_ms": 1.0}))
    await wait_until(lambda: all(t.state == "running" for t in manager.tasks.values()), 60, "tasks set up")
    sim_a, sim_b = SimPipeline(job_a).start(), SimPipeline(job_b).start()
    try:
        victim = job_a.device(1)
        await wait_until(
            lambda: victim in manager.devices and manager.devices[victim].framework == "sim", 30, "job A's Hello"
        )
        await wait_until(lambda: manager.schedulers[victim].bubbles > 5, 30, "job A's bubbles")
        os.kill(sim_a.processes[1].pid or 0, signal.SIGKILL)
        t_kill = time.monotonic()
        await wait_until(lambda: not manager.devices[victim].alive, 5, "the manager to notice the dead rank")
        noticed_s = time.monotonic() - t_kill
        steps_then = sum(t.steps for t in manager.tasks.values())
        await wait_until(
            lambda: sum(t.steps for t in manager.tasks.values()) > steps_then + 50, 30, "job B's side tasks"
        )
        results_b = await asyncio.to_thread(sim_b.join, 60)
        assert [len(r.step_ns) for r in results_b] == [60, 60]
        assert manager.devices[job_b.device(0)].alive is False  # B said goodbye at the end
        assert noticed_s < 1.0
    finally:
        sim_a.terminate()
        sim_b.terminate()


def test_emitter_never_blocks_after_the_manager_is_killed(served: object, runtime_dir: Path) -> None:
    import subprocess

    assert isinstance(served, subprocess.Popen)
    emitter = EventEmitter(Endpoints.ipc(runtime_dir).events)
    hello = p.Hello(
        protocol_version=p.PROTOCOL_VERSION,
        rank=0,
        stage=0,
        num_stages=1,
        device="cpu:0",
        framework="x",
        pid=os.getpid(),
    )
    poll(lambda: emitter.emit(hello), 10, "the connection")
    poll(lambda: status(runtime_dir).events > 0, 10, "the manager to count our event")
    os.killpg(served.pid, signal.SIGKILL)
    served.wait(10)
    worst = 0
    t0 = time.perf_counter_ns()
    for i in range(10_000):
        a = time.perf_counter_ns()
        emitter.emit(p.Heartbeat(rank=0, t_ns=i))
        worst = max(worst, time.perf_counter_ns() - a)
    total = time.perf_counter_ns() - t0
    emitter.close(p.Goodbye(rank=0, t_ns=0))
    assert emitter.dropped > 0
    assert total < 2_000_000_000 and worst < 200_000_000, (total, worst)


@pytest.mark.parametrize("sig", [signal.SIGKILL])
def test_workers_die_with_a_killed_manager(served: object, runtime_dir: Path, tmp_path: Path, sig: int) -> None:
    """A SIGKILLed manager cannot stop its side tasks; they must not outlive it (parent-death signal)."""
    import subprocess

    assert isinstance(served, subprocess.Popen)
    sim = subprocess.Popen(
        [*_cli("sim"), "--runtime-dir", str(runtime_dir), "--steps", "400", "--forward", "5ms", "--backward", "10ms"],
        start_new_session=True,
    )
    try:
        poll(lambda: len(status(runtime_dir).devices) == 2, 30, "the simulated ranks")
        _submit(runtime_dir, "cpu:0")
        poll(lambda: any(t.pid and t.state == "running" for t in status(runtime_dir).tasks), 60, "a running worker")
        pid = next(t.pid for t in status(runtime_dir).tasks if t.pid)
        os.kill(served.pid, sig)
        served.wait(10)
        poll(lambda: not _alive(pid), 10, f"worker {pid} to exit")
    finally:
        os.killpg(sim.pid, signal.SIGKILL)
        sim.wait()


def _cli(*args: str) -> list[str]:
    from conftest import freeride_cmd

    return freeride_cmd(*args)


def _submit(runtime_dir: Path, device: str) -> None:
    import subprocess

    subprocess.run(
        [
            *_cli("submit"),
            "--runtime-dir",
            str(runtime_dir),
            "_tasks:SpinSteps",
            "--device",
            device,
            "--step-time",
            "2ms",
        ],
        check=True,
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# Race pinned: an exception raised while starting a task's worker used to escape
# the supervision coroutine into the manager's TaskGroup and end the manager.
async def test_a_task_that_cannot_start_fails_alone(runtime_dir: Path) -> None:
    from freeride.serve.config import ServeConfig

    config = ServeConfig(
        endpoints=Endpoints.ipc(runtime_dir), state_dir=runtime_dir / "state", python=str(runtime_dir / "no-python")
    )
    stop = asyncio.Event()
    async with Manager(config) as manager:
        runner = asyncio.create_task(manager.run(stop))
        manager.declare_device("cpu:0", stage=0, spare_memory=1 << 30, cpu_affinity=[0])
        reply = manager.submit(p.IterativeSpec(target="_tasks:SpinSteps", device="cpu:0"))
        assert isinstance(reply, p.Submitted)
        task = manager.tasks[reply.task_id]
        await wait_until(lambda: task.state == "failed", 10, "the task to fail")
        assert "no-python" in task.error
        assert not runner.done()  # the manager is still serving
        second = manager.submit(p.ProgramSpec(argv=["true"], device="cpu:0"))
        assert isinstance(second, p.Submitted)
        stop.set()
        await runner


async def test_a_silent_rank_that_cannot_be_watched_is_declared_lost(runtime_dir: Path) -> None:
    """A rank whose pid is not ours to watch (another PID namespace) is judged by its silence."""
    from freeride.serve.config import ServeConfig

    config = ServeConfig(endpoints=Endpoints.ipc(runtime_dir), state_dir=runtime_dir / "state", backend_timeout_s=0.5)
    stop = asyncio.Event()
    async with Manager(config) as manager:
        runner = asyncio.create_task(manager.run(stop))
        emitter = EventEmitter(config.endpoints.events)
        not_ours = 4_000_000  # above pid_max: pidfd_open fails as it would across namespaces
        hello = p.Hello(
            protocol_version=p.PROTOCOL_VERSION,
            rank=0,
            stage=0,
            num_stages=1,
            device="cpu:0",
            framework="x",
            pid=not_ours,
        )
        try:
            while not emitter.emit(hello):
                await asyncio.sleep(0.01)
            await wait_until(lambda: manager.live_backends() == [0], 5, "the rank")
            for _ in range(5):  # heartbeats keep it alive past the timeout
                emitter.emit(p.Heartbeat(rank=0, t_ns=time.monotonic_ns()))
                await asyncio.sleep(0.2)
            assert manager.live_backends() == [0]
            await wait_until(lambda: not manager.devices["cpu:0"].alive, 5, "the silent rank to be dropped")
        finally:
            emitter.close()
            stop.set()
            await runner
