"""Side tasks leave SMs for the trainer: the SM share from submit to the task's environment and status,
the lowest-priority stream, and step times that end when the device's work ends.

No CUDA here: the stream calls go to a small stand-in of ``torch.cuda``, and
the gate runs on a manual clock whose device sync advances it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from freeride import protocol as p
from freeride.cli.status import format_status
from freeride.clock import ManualClock
from freeride.gpu.smshare import DEFAULT_SM_SHARE, ENV_SM_SHARE, plan_sm_share, resolve_sm_share
from freeride.gpu.streams import step_end_sync, use_side_stream
from freeride.observe.base import Observers
from freeride.serve.config import ServeConfig
from freeride.serve.ranks import DeviceInfo
from freeride.serve.supervisor import Supervisor
from freeride.serve.tasks import TaskRecord
from freeride.sidetask import IterativeTask
from freeride.transport import Endpoints
from freeride.worker.gate import GrantGate

MS = 1_000_000


# ------------------------------------------------------------------ the share


def test_share_defaults_leave_room_for_nccl_and_requests_are_checked() -> None:
    assert 50 <= DEFAULT_SM_SHARE < 100
    assert resolve_sm_share(-1) == resolve_sm_share(0) == DEFAULT_SM_SHARE
    assert resolve_sm_share(30) == 30
    with pytest.raises(ValueError, match="sm_share"):
        resolve_sm_share(101)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"type": "iterative_spec", "target": "m:C", "sm_share": 150}', type=p.TaskSpec)


def test_share_applies_only_to_gpu_tasks_under_mps(tmp_path: Path) -> None:
    share, env = plan_sm_share("cuda:0", 40, mps_pipe_dir=tmp_path)
    assert share == 40
    assert env == {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path), ENV_SM_SHARE: "40"}
    assert plan_sm_share("cuda:0", 40, mps_pipe_dir=None) == (-1, {})
    assert plan_sm_share("cpu:1", 40, mps_pipe_dir=tmp_path) == (-1, {})


def _supervisor(tmp_path: Path, mps: bool) -> tuple[Supervisor, TaskRecord]:
    config = ServeConfig(endpoints=Endpoints.ipc(tmp_path), state_dir=tmp_path / "s")
    device = DeviceInfo(name="cuda:0", first_seen_ns=0, device_memory=80 << 30, spare_memory=40 << 30)
    sup = Supervisor(config, devices={"cuda:0": device}, schedulers={}, send=lambda i, m: True, observers=Observers())
    sup.mps_pipe_dir = tmp_path / "mps" if mps else None
    spec = p.IterativeSpec(target="m:C", peak_memory=2 << 30, sm_share=-1)
    task = TaskRecord(task_id=1, spec=spec, name="t", checkpoint_path=tmp_path / "c", device="cuda:0")
    return sup, task


@pytest.mark.parametrize("mps", [True, False])
def test_supervisor_puts_the_share_in_the_env_and_status_shows_it(tmp_path: Path, mps: bool) -> None:
    sup, task = _supervisor(tmp_path, mps)
    env = sup.processes.memory_cap(task).env
    status = task.status()
    if mps:
        assert env[ENV_SM_SHARE] == str(DEFAULT_SM_SHARE)
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps")
        assert status.sm_share == DEFAULT_SM_SHARE
    else:  # nothing could enforce it
        assert ENV_SM_SHARE not in env
        assert status.sm_share == -1
    reply = p.StatusReply(
        devices=[], tasks=[status], latency=p.LatencySummary(count=0, p50_ns=0, p99_ns=0, max_ns=0),
        events=0, rejected_frames=0, uptime_ns=0,
    )  # fmt: skip
    shown = format_status(reply)
    assert " sm " in shown.splitlines()[2]
    assert (f"{DEFAULT_SM_SHARE}%" in shown) == mps


# ------------------------------------------------------------------ streams


class FakeCuda:
    """Stand-in for the torch.cuda calls of freeride.gpu.streams (no CUDA on CPU machines)."""

    def __init__(self, clock: ManualClock | None = None, device_lag_ns: int = 0) -> None:
        self.current: Any = None
        self.synced: list[Any] = []
        self.clock = clock
        self.device_lag_ns = device_lag_ns
        cuda = self

        class Stream:
            @staticmethod
            def priority_range() -> tuple[int, int]:
                return (0, -5)

            def __init__(self, device: str, priority: int) -> None:
                self.device, self.priority = device, priority

        class Event:
            def __init__(self, blocking: bool = False) -> None:
                assert blocking, "the worker must sleep, not spin, while its step drains"
                self.stream: Any = None

            def record(self, stream: Any) -> None:
                self.stream = stream

            def synchronize(self) -> None:
                cuda.synced.append(self.stream)
                if cuda.clock is not None:
                    cuda.clock.advance(cuda.device_lag_ns)  # the device finishes after the host

        self.Stream = Stream
        self.Event = Event

    def set_stream(self, stream: Any) -> None:
        self.current = stream


def test_side_task_stream_is_the_least_urgent_and_cpu_is_untouched() -> None:
    cuda = FakeCuda()
    setup = use_side_stream("cuda:0", cuda=cuda)
    assert setup is not None and setup.priority == 0  # (least, greatest) = (0, -5)
    assert cuda.current is setup.stream and setup.stream.priority == 0
    assert use_side_stream("cpu", cuda=cuda) is None
    assert step_end_sync(None) is None


class _Link:
    def __init__(self) -> None:
        self.sent: list[p.WorkerToManager] = []
        self.inbox: list[p.ManagerToWorker] = []

    def recv_nowait(self) -> p.ManagerToWorker | None:
        return self.inbox.pop(0) if self.inbox else None

    async def recv(self) -> p.ManagerToWorker:
        raise AssertionError("the test grants before stepping")

    def send_nowait(self, msg: p.WorkerToManager) -> None:
        self.sent.append(msg)


class _Task(IterativeTask):
    def step(self) -> None:
        pass


class _NoDelay:
    def ns(self) -> int:
        return 0

    def close(self) -> None:
        pass


async def test_step_time_is_the_devices_when_the_gate_syncs_on_an_event(tmp_path: Path) -> None:
    clock = ManualClock()
    cuda = FakeCuda(clock, device_lag_ns=3 * MS)
    setup = use_side_stream("cuda:0", cuda=cuda)
    link = _Link()
    assign = p.Assign(
        task_id=1,
        spec=p.IterativeSpec(target="m:C", step_time_ns=2 * MS),
        device="cuda:0",
        checkpoint_path=str(tmp_path / "c.pt"),
        margin_ns=0,
        checkpoint_every_ns=10**15,
    )
    gate = GrantGate(
        link,  # type: ignore[arg-type]  # the two calls used here
        assign,
        _Task(),
        0,
        save=lambda task, path, steps: 0,
        clock=clock,
        cpu_clock=clock.now_ns,
        run_delay=_NoDelay(),
        device_sync=step_end_sync(setup),
    )
    now = clock.now_ns()
    link.inbox.append(p.Grant(grant_id=1, bubble_t_ns=now, deadline_ns=now + 100 * MS))
    async with asyncio.timeout(5), gate.step():
        clock.advance(1 * MS)  # the host queues the step's kernels in 1 ms
    assert cuda.synced == [setup.stream if setup is not None else None]
    assert gate.estimate_ns == 4 * MS  # 1 ms on the host + 3 ms until the device is done
