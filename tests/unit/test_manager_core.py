"""The manager's socket-free core, fed events and requests directly: no socket, no process."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import msgspec

from freeride import protocol as p
from freeride.serve.config import ServeConfig
from freeride.serve.core import ManagerCore
from freeride.transport import BadFrame, Endpoints, bubbles_endpoint

MS = 1_000_000


def core(tmp_path: Path, **config: Any) -> tuple[ManagerCore, list[tuple[bytes, p.ManagerToWorker]]]:
    sent: list[tuple[bytes, p.ManagerToWorker]] = []

    def send(ident: bytes, msg: p.ManagerToWorker) -> bool:
        sent.append((ident, msg))
        return True

    settings = ServeConfig(endpoints=Endpoints.ipc(tmp_path), state_dir=tmp_path / "state", **config)
    return ManagerCore(settings, send=send), sent


def hello(rank: int, *, device: str, endpoint: str = "") -> p.Hello:
    return p.Hello(
        protocol_version=p.PROTOCOL_VERSION, rank=rank, stage=rank, num_stages=2, device=device, framework="sim",
        pid=1000 + rank, t_ns=0, bubbles_endpoint=endpoint, job="job",
    )  # fmt: skip


def bubble(rank: int, step: int, t_ns: int, *, length_ns: int = 20 * MS) -> tuple[p.BubbleStarted, p.BubbleEnded]:
    device = f"cpu:{rank}"
    start = p.BubbleStarted(
        rank=rank, stage=rank, device=device, step=step, index=0, t_ns=t_ns, expected_ns=length_ns, spare_memory=1 << 30
    )
    end = p.BubbleEnded(
        rank=rank, stage=rank, device=device, step=step, index=0, t_ns=t_ns + length_ns, duration_ns=length_ns
    )
    return start, end


def test_ranks_and_their_bubbles_make_devices_with_schedulers_and_a_status(tmp_path: Path) -> None:
    mgr, _ = core(tmp_path)
    for rank in (0, 1):
        mgr.on_event(hello(rank, device=f"cpu:{rank}"))
    assert sorted(mgr.devices) == ["cpu:0", "cpu:1"] and sorted(mgr.schedulers) == ["cpu:0", "cpu:1"]
    for step in range(3):
        start, end = bubble(0, step, (step + 1) * 100 * MS)
        mgr.on_event(start)
        mgr.on_event(end)
        mgr.on_event(p.StepFinished(rank=0, stage=0, step=step, t_ns=end.t_ns, duration_ns=100 * MS, bubble_ns=20 * MS))
    status = mgr.status()
    assert isinstance(status, p.StatusReply) and status.events == 2 + 3 * 3
    [cpu0] = [d for d in status.devices if d.device == "cpu:0"]
    assert (cpu0.bubbles, cpu0.bubble_ns, cpu0.steps, cpu0.spare_memory) == (3, 60 * MS, 3, 1 << 30)
    assert isinstance(mgr.on_control(p.StatusRequest()), p.StatusReply)


def test_a_bad_frame_and_a_foreign_bubbles_endpoint_are_counted_and_refused(tmp_path: Path) -> None:
    mgr, _ = core(tmp_path)
    mgr.on_event(BadFrame(reason="not msgpack", size=3))
    mgr.on_event(hello(0, device="cpu:0", endpoint="ipc:///tmp/elsewhere"))
    assert mgr.rejected_frames == 2
    assert mgr.schedulers["cpu:0"].bubbles_endpoint == ""  # an armed worker never connects elsewhere
    own = bubbles_endpoint(mgr.config.endpoints.events, 1)
    mgr.on_event(hello(1, device="cpu:1", endpoint=own))
    assert mgr.schedulers["cpu:1"].bubbles_endpoint == own and mgr.rejected_frames == 2
    reply = mgr.on_control(BadFrame(reason="truncated", size=1))
    assert isinstance(reply, p.Rejected) and "malformed request: truncated" in reply.reason


async def test_a_task_submitted_by_request_is_placed_and_a_cancel_before_its_worker_starts_ends_it(
    tmp_path: Path,
) -> None:
    """Submitted through the control path as a client would; its worker has not started when it is cancelled."""
    mgr, sent = core(tmp_path)
    mgr.declare_device("cpu:0", stage=0, spare_memory=1 << 30, cpu_affinity=[0])
    reply = mgr.on_control(p.Submit(spec=p.IterativeSpec(target="pagerank", device="cpu:0")))
    assert isinstance(reply, p.Submitted) and reply.device == "cpu:0"
    [task] = mgr.status().tasks
    assert (task.kind, task.device) == ("iterative", "cpu:0")
    assert mgr.tasks[reply.task_id].spec.target == "freeride.sidetasks.pagerank:PageRank"  # one spelling per task
    refused = mgr.on_control(p.Cancel(task_id=reply.task_id))
    assert refused == p.Rejected(reason="the manager is not running")  # nothing would carry the stop out
    stops: list[asyncio.Task[None]] = []

    def spawn(coro: Coroutine[Any, Any, None], name: str) -> None:
        if name.startswith("cancel-"):
            stops.append(asyncio.ensure_future(coro))
        else:
            coro.close()  # the loops and the task's own supervision (which would start its worker) stay out

    mgr.supervisor.start(spawn)
    assert mgr.on_control(p.Cancel(task_id=reply.task_id)) == p.Cancelled(task_id=reply.task_id, kind="iterative")
    await asyncio.gather(*stops)
    mgr.supervisor.stop()
    assert mgr.tasks[reply.task_id].state == "cancelled" and sent == []
    unknown = mgr.on_control(p.Cancel(task_id=99))
    assert isinstance(unknown, p.Rejected) and "no task 99" in unknown.reason


def test_a_device_whose_job_ended_takes_no_new_task_and_says_why(tmp_path: Path) -> None:
    """A pipeline-size-1 job keeps an unpinned task pending; when that job ends, its departed device must not
    take the task (it was placed there and showed `running` with 0 steps and no reason)."""
    mgr, _ = core(tmp_path, settle_s=0.0)
    single = msgspec.structs.replace(hello(0, device="cpu:0"), num_stages=1)
    mgr.on_event(single)
    reply = mgr.on_control(p.Submit(spec=p.IterativeSpec(target="pagerank")))
    assert isinstance(reply, p.Submitted) and reply.device == ""
    task = mgr.tasks[reply.task_id]
    assert "pipeline size 1" in task.pending_reason
    mgr.on_event(p.Goodbye(rank=0, t_ns=1, dropped=0))
    mgr.supervisor.place_pending()
    assert task.state == "pending" and task.device == ""
    assert "the training ranks of cpu:0 have left" in task.pending_reason, task.pending_reason
    mgr.on_event(msgspec.structs.replace(hello(1, device="cpu:0"), num_stages=2))  # a new job with bubbles
    mgr.supervisor.place_pending()
    assert task.device == "cpu:0" and task.pending_reason == ""
