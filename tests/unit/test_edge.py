"""Hostile but well-formed input at the manager's edge: rejected, bounded, or neutralised.

No sockets: the decoders, ranks, scheduler, supervisor and status text are
driven by hand. The same scenarios over real sockets are in tests/ipc/test_flood.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from freeride import protocol as p
from freeride.cli.status import format_status
from freeride.clock import ManualClock
from freeride.observe.base import Observers
from freeride.observe.stats import LatencyRecorder
from freeride.serve.config import ServeConfig
from freeride.serve.ranks import DeviceInfo, Ranks
from freeride.serve.scheduler import DeviceScheduler
from freeride.serve.supervisor import KEEP_ENDED, Supervisor
from freeride.serve.tasks import TaskRecord
from freeride.transport import Endpoints

U64_MAX = 2**64 - 1
I64_MAX = 2**63 - 1

events = msgspec.msgpack.Decoder(p.BackendEvent)
from_workers = msgspec.msgpack.Decoder(p.WorkerToManager)
requests = msgspec.msgpack.Decoder(p.ControlRequest)


def frame(msg: dict[str, object]) -> bytes:
    """A frame as any sender could write it: the constructors do not check bounds, the decoders do."""
    return msgspec.msgpack.encode(msg)


def ended(**over: object) -> dict[str, object]:
    fields: dict[str, object] = {
        "type": "bubble_ended",
        "rank": 0,
        "stage": 0,
        "device": "cpu:0",
        "step": 1,
        "index": 0,
        "t_ns": 10,
        "duration_ns": 5,
    }
    return {**fields, **over}


def started(**over: object) -> dict[str, object]:
    fields: dict[str, object] = {
        "type": "bubble_started",
        "rank": 0,
        "stage": 0,
        "device": "cpu:0",
        "step": 1,
        "index": 0,
        "t_ns": 10,
        "expected_ns": 5,
    }
    return {**fields, **over}


# -- the decoders --------------------------------------------------------------------


@pytest.mark.parametrize(
    "msg",
    [
        ended(duration_ns=U64_MAX),
        ended(duration_ns=-5),
        ended(t_ns=I64_MAX + 1),
        started(expected_ns=U64_MAX),
        started(t_ns=-1),
        started(rank=2**31),
        started(device="x" * 257),
        started(spare_memory=-2),
        {"type": "goodbye", "rank": 0, "t_ns": 0, "dropped": U64_MAX},
        {"type": "step_finished", "rank": 0, "stage": 0, "step": 0, "t_ns": 0, "duration_ns": -1},
        {
            "type": "hello",
            "protocol_version": 1,
            "rank": 0,
            "stage": 0,
            "num_stages": 1,
            "device": "cpu:0",
            "framework": "sim",
            "pid": 1,
            "cpu_affinity": list(range(5000)),
        },
    ],
    ids=lambda m: str(m.get("type")),
)
def test_an_event_with_a_value_out_of_bounds_does_not_decode(msg: dict[str, object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        events.decode(frame(msg))


def test_every_legitimate_extreme_decodes() -> None:
    assert events.decode(frame(ended(t_ns=I64_MAX, duration_ns=I64_MAX, step=-1)))
    assert events.decode(frame(started(t_ns=I64_MAX, expected_ns=0, spare_memory=-1)))
    done = {
        "type": "grant_done",
        "task_id": 1,
        "grant_id": 1,
        "steps": 0,
        "busy_ns": 0,
        "first_step_delay_ns": -1,
        "overrun_ns": 0,
        "reason": "no_fit",
        "step_estimate_ns": -1,
        "total_steps": -1,
        "cpu_ns": -1,
    }
    assert from_workers.decode(frame(done))
    spec = {"type": "iterative_spec", "target": "m:C", "peak_memory": -1, "step_time_ns": -1}
    assert requests.decode(frame({"type": "submit", "spec": spec}))


def test_worker_and_control_frames_are_bounded_too() -> None:
    with pytest.raises(msgspec.ValidationError):
        from_workers.decode(frame({"type": "progress", "task_id": 1, "steps": 1, "metrics": {"k" * 300: 1.0}}))
    with pytest.raises(msgspec.ValidationError):
        from_workers.decode(
            frame({"type": "progress", "task_id": 1, "steps": 1, "metrics": {str(i): 1.0 for i in range(2000)}})
        )
    with pytest.raises(msgspec.ValidationError):
        requests.decode(frame({"type": "cancel", "task_id": U64_MAX}))
    with pytest.raises(msgspec.ValidationError):
        requests.decode(frame({"type": "submit", "spec": {"type": "program_spec", "argv": ["a"] * 5000}}))


# -- the scheduler's sums ---------------------------------------------------------------


class _Runner:
    pid = 4242
    alive = True

    def __init__(self) -> None:
        self.grants: list[p.Grant] = []

    def cpu_ns(self) -> int:
        return -1

    def cpu_at_grant(self) -> int:
        return -1

    def grant(self, grant: p.Grant) -> bool:
        self.grants.append(grant)
        return True

    def revoke(self, grant_id: int) -> None:
        pass

    def stop(self, reason: str) -> None:
        pass


def _task(task_id: int, device: str = "cpu:0") -> TaskRecord:
    task = TaskRecord(
        task_id=task_id, spec=p.IterativeSpec(target="m:C"), name=f"t{task_id}", checkpoint_path=Path("/x")
    )
    task.place(device)
    return task


def test_sums_saturate_at_the_largest_value_the_wire_carries() -> None:
    clock = ManualClock()
    sched = DeviceScheduler("cpu:0", latency=LatencyRecorder(), margin_ns=0, clock=clock)
    for _ in range(3):
        sched.on_bubble_ended(msgspec.convert(ended(t_ns=I64_MAX, duration_ns=I64_MAX), p.BubbleEnded))
    status = sched.status(DeviceInfo(name="cpu:0", first_seen_ns=0))
    assert status.bubble_ns == I64_MAX
    msgspec.msgpack.encode(
        p.StatusReply(
            devices=[status],
            tasks=[],
            latency=p.LatencySummary(count=0, p50_ns=0, p99_ns=0, max_ns=0),
            events=0,
            rejected_frames=0,
            uptime_ns=0,
        )
    )


def test_a_bubble_expected_to_last_forever_gets_a_deadline_the_wire_carries() -> None:
    clock = ManualClock()
    sched = DeviceScheduler("cpu:0", latency=LatencyRecorder(), margin_ns=0, clock=clock)
    task = _task(1)
    runner = _Runner()
    task.runner = runner
    task.ready(estimate_ns=1000)
    sched.on_task_changed(task)
    sched.on_bubble_started(msgspec.convert(started(t_ns=I64_MAX, expected_ns=I64_MAX), p.BubbleStarted))
    assert len(runner.grants) == 1 and runner.grants[0].deadline_ns == I64_MAX
    msgspec.msgpack.encode(runner.grants[0])


def test_a_task_that_leaves_takes_its_grants_and_counters_with_it() -> None:
    clock = ManualClock()
    sched = DeviceScheduler("cpu:0", latency=LatencyRecorder(), margin_ns=0, clock=clock)
    task = _task(1)
    task.runner = _Runner()
    task.ready(estimate_ns=1000)
    sched.on_task_changed(task)
    sched.on_bubble_started(msgspec.convert(started(t_ns=0, expected_ns=10**9), p.BubbleStarted))
    assert sched.in_use
    task.cancel()
    sched.on_task_changed(task)
    assert not sched.in_use


# -- ranks and devices ------------------------------------------------------------------


class _Listener:
    def __init__(self) -> None:
        self.added: list[str] = []
        self.removed: list[str] = []
        self.refused: list[str] = []
        self.busy: set[str] = set()

    def device_added(self, info: DeviceInfo) -> None:
        self.added.append(info.name)

    def device_lost(self, name: str) -> None:
        pass

    def read_queued_events(self) -> None:
        pass

    def rank_ready(self, info: DeviceInfo) -> None:
        pass

    def device_in_use(self, name: str) -> bool:
        return name in self.busy

    def device_removed(self, name: str) -> None:
        self.removed.append(name)

    def event_refused(self, reason: str) -> None:
        self.refused.append(reason)


def _hello(rank: int, device: str, pid: int) -> p.Hello:
    return p.Hello(
        protocol_version=p.PROTOCOL_VERSION,
        rank=rank,
        stage=0,
        num_stages=1,
        device=device,
        framework="sim",
        pid=pid,
    )


def _started(rank: int, device: str) -> p.BubbleStarted:
    return p.BubbleStarted(rank=rank, stage=0, device=device, step=0, index=0, t_ns=0, expected_ns=1)


async def test_a_new_device_name_per_event_keeps_the_table_bounded() -> None:
    listener = _Listener()
    ranks = Ranks(listener=listener, backend_timeout_s=5, clock=ManualClock(), max_devices=8)
    ranks.declare("cpu:9", stage=0, spare_memory=0, cpu_affinity=[])
    listener.busy.add("gpu-busy")
    assert ranks.bubble(_started(1, "gpu-busy")) is not None
    for i in range(1000):
        assert ranks.bubble(_started(0, f"dev-{i}")) is not None
    assert len(ranks.devices) == 8
    # the rank's current device, the declared one and the one in use are never the ones forgotten
    assert {"dev-999", "cpu:9", "gpu-busy"} <= set(ranks.devices)
    assert len(listener.removed) == 1000 + 2 - 8 and not listener.refused
    ranks.close()


async def test_a_device_table_full_of_live_devices_refuses_a_new_name() -> None:
    listener = _Listener()
    ranks = Ranks(listener=listener, backend_timeout_s=5, clock=ManualClock(), max_devices=4)
    for rank in range(4):
        assert ranks.bubble(_started(rank, f"dev-{rank}")) is not None
    assert ranks.bubble(_started(9, "dev-9")) is None
    assert not ranks.hello(_hello(10, "dev-10", os.getpid()))
    assert len(ranks.devices) == 4 and len(listener.refused) == 1
    ranks.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_hello_flood_holds_at_most_max_ranks_pidfds() -> None:
    listener = _Listener()
    ranks = Ranks(listener=listener, backend_timeout_s=5, clock=ManualClock(), max_ranks=16, max_devices=64)
    before = _open_fds()
    accepted = sum(ranks.hello(_hello(rank, f"cpu:{rank % 4}", os.getpid())) for rank in range(500))
    assert accepted == 16 and ranks.watched() == 16 and _open_fds() - before == 16
    # a rank that restarts under the same number keeps one pidfd
    assert ranks.hello(_hello(3, "cpu:3", os.getppid()))
    assert _open_fds() - before == 16
    ranks.close()
    assert _open_fds() == before


async def test_a_rank_that_says_hello_displaces_ranks_known_only_by_their_events() -> None:
    listener = _Listener()
    clock = ManualClock()
    ranks = Ranks(listener=listener, backend_timeout_s=5, clock=clock, max_ranks=4, max_devices=64)
    for rank in range(10):
        clock.advance(1)
        ranks.bubble(_started(rank, f"dev-{rank}"))
    assert len(ranks.live()) == 4 and len(listener.refused) == 6
    assert ranks.hello(_hello(100, "cuda:0", os.getpid()))
    assert 100 in ranks.live() and 0 not in ranks.live()  # the least recently seen gave way
    ranks.close()


async def test_a_wrong_version_flood_is_logged_sampled(caplog: pytest.LogCaptureFixture) -> None:
    ranks = Ranks(listener=_Listener(), backend_timeout_s=5, clock=ManualClock())
    old = msgspec.structs.replace(_hello(0, "cpu:0", os.getpid()), protocol_version=p.PROTOCOL_VERSION + 1)
    for _ in range(3000):
        assert not ranks.hello(old)
    assert len([r for r in caplog.records if "speaks protocol" in r.getMessage()]) == 10 + 3


# -- the task table ----------------------------------------------------------------------


def test_ended_tasks_beyond_the_bound_are_dropped(tmp_path: Path) -> None:
    config = ServeConfig(endpoints=Endpoints.ipc(tmp_path), state_dir=tmp_path / "s")
    sup = Supervisor(config, devices={}, schedulers={}, send=lambda ident, msg: True, observers=Observers())
    spec = p.ProgramSpec(argv=["sh", "-c", "true"])
    for _ in range(KEEP_ENDED + 50):
        reply = sup.submit(spec)
        assert isinstance(reply, p.Submitted)
        sup.tasks[reply.task_id].cancel()
    live = sup.submit(spec)
    assert isinstance(live, p.Submitted)
    ended = [t for t in sup.tasks.values() if t.terminal]
    assert len(ended) == KEEP_ENDED and live.task_id in sup.tasks
    assert min(t.task_id for t in ended) == 51  # the oldest went first


def test_unknown_worker_messages_are_logged_sampled(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = ServeConfig(endpoints=Endpoints.ipc(tmp_path), state_dir=tmp_path / "s")
    sup = Supervisor(config, devices={}, schedulers={}, send=lambda ident, msg: True, observers=Observers())
    for _ in range(2000):
        sup.on_worker(b"task-7", p.Progress(task_id=7, steps=1))
    assert len([r for r in caplog.records if "unknown task" in r.getMessage()]) == 10 + 2


# -- what status prints ---------------------------------------------------------------------


def test_status_text_escapes_control_characters_and_json_stays_exact() -> None:
    evil = "\x1b]0;pwned\x07\x1b[2J\u202e"
    reply = p.StatusReply(
        devices=[
            p.DeviceStatus(
                device=f"cpu:0{evil}",
                stage=0,
                rank=0,
                framework="sim",
                alive=True,
                bubbles=1,
                bubble_ns=1,
                used_ns=0,
                overruns=0,
                overrun_ns=0,
                spare_memory=-1,
                steps=0,
            )
        ],
        tasks=[
            p.TaskStatus(
                task_id=1,
                name=f"t{evil}",
                kind="iterative",
                state="failed",
                device=f"cpu:0{evil}",
                steps=0,
                busy_ns=0,
                metrics={f"loss{evil}": 1.0},
                error=f"boom{evil}\nline two",
            )
        ],
        latency=p.LatencySummary(count=0, p50_ns=0, p99_ns=0, max_ns=0),
        events=1,
        rejected_frames=0,
        uptime_ns=1,
    )
    text = format_status(reply)
    assert all(c == "\n" or c.isprintable() for c in text)
    assert "\\x1b]0;pwned\\x07" in text and "\\u202e" in text and "boom" in text
    assert msgspec.json.decode(msgspec.json.encode(reply), type=p.StatusReply) == reply
