"""The per-device scheduler: who gets each bubble, and what it is charged."""

from __future__ import annotations

import time
from pathlib import Path

from freeride import protocol as p
from freeride.observe.stats import LatencyRecorder
from freeride.serve.scheduler import DeviceScheduler, TaskChanged, WorkerReport
from freeride.serve.tasks import TaskRecord

MS = 1_000_000


class Wire:
    def __init__(self) -> None:
        self.sent: list[tuple[int, p.ManagerToWorker]] = []

    def __call__(self, task: TaskRecord, msg: p.ManagerToWorker) -> bool:
        self.sent.append((task.task_id, msg))
        return True

    def grants(self) -> list[tuple[int, p.Grant]]:
        return [(t, m) for t, m in self.sent if isinstance(m, p.Grant)]


def make(margin_ns: int = 0) -> tuple[DeviceScheduler, Wire, LatencyRecorder]:
    wire, latency = Wire(), LatencyRecorder()
    return DeviceScheduler("cpu:0", send=wire, latency=latency, margin_ns=margin_ns), wire, latency


def task(task_id: int, estimate_ns: int, sched: DeviceScheduler) -> TaskRecord:
    t = TaskRecord(
        task_id=task_id, spec=p.TaskSpec(kind="iterative", target="m:C"), name=f"t{task_id}", checkpoint_path=Path("/x")
    )
    t.device, t.state, t.runnable, t.estimate_ns = "cpu:0", "running", True, estimate_ns
    sched.handle(TaskChanged(t))
    return t


def started(expected_ns: int, *, step: int = 0, index: int = 0, spare: int = -1) -> p.BubbleStarted:
    return p.BubbleStarted(
        rank=0,
        stage=0,
        device="cpu:0",
        step=step,
        index=index,
        t_ns=time.monotonic_ns(),
        expected_ns=expected_ns,
        spare_memory=spare,
    )


def ended(start: p.BubbleStarted, duration_ns: int) -> p.BubbleEnded:
    return p.BubbleEnded(
        rank=0,
        stage=0,
        device="cpu:0",
        step=start.step,
        index=start.index,
        t_ns=start.t_ns + duration_ns,
        duration_ns=duration_ns,
    )


def done(
    t: TaskRecord, grant: p.Grant, *, reason: str = "no_fit", busy: int = 0, delay: int = 100, end: int = 0
) -> WorkerReport:
    return WorkerReport(
        t,
        p.GrantDone(
            task_id=t.task_id,
            grant_id=grant.grant_id,
            steps=1 if busy else 0,
            busy_ns=busy,
            first_step_delay_ns=delay if busy else -1,
            overrun_ns=0,
            reason=reason,  # type: ignore[arg-type]
            step_estimate_ns=t.estimate_ns,
            last_step_end_ns=end,
        ),
    )


def test_a_bubble_is_granted_up_to_its_expected_end() -> None:
    sched, wire, _ = make()
    task(1, 2 * MS, sched)
    b = started(50 * MS, spare=3 << 30)
    sched.handle(b)
    [(tid, grant)] = wire.grants()
    assert tid == 1 and grant.bubble_t_ns == b.t_ns and grant.deadline_ns == b.t_ns + 50 * MS
    assert sched.spare_memory == 3 << 30


def test_a_step_that_cannot_fit_gets_no_grant() -> None:
    sched, wire, _ = make(margin_ns=1 * MS)
    task(1, 10 * MS, sched)
    sched.handle(started(10 * MS))  # 10 ms step + 1 ms margin > 10 ms bubble
    assert wire.grants() == []


def test_the_rest_of_a_bubble_passes_to_a_task_that_fits() -> None:
    sched, wire, _ = make()
    big, small = task(1, 20 * MS, sched), task(2, 1 * MS, sched)
    sched.handle(started(50 * MS))
    [(first, grant)] = wire.grants()
    assert first == 1
    sched.handle(done(big, grant, busy=20 * MS))
    assert [t for t, _ in wire.grants()] == [1, 2]
    assert small.task_id == 2


def test_a_task_is_not_granted_twice_in_one_bubble() -> None:
    sched, wire, _ = make()
    t = task(1, 1 * MS, sched)
    sched.handle(started(50 * MS))
    [(_, grant)] = wire.grants()
    sched.handle(done(t, grant, busy=40 * MS))
    assert len(wire.grants()) == 1


def test_tasks_take_turns_across_bubbles() -> None:
    sched, wire, _ = make()
    a, b = task(1, 1 * MS, sched), task(2, 1 * MS, sched)
    for i in range(4):
        bubble = started(50 * MS, index=i)
        sched.handle(bubble)
        tid, grant = wire.grants()[-1]
        holder = a if tid == 1 else b
        sched.handle(done(holder, grant, reason="revoked", busy=1 * MS))
        sched.handle(ended(bubble, 50 * MS))
    assert [t for t, _ in wire.grants()] == [1, 2, 1, 2]


def test_bubble_end_revokes_the_grant() -> None:
    sched, wire, _ = make()
    task(1, 1 * MS, sched)
    b = started(50 * MS)
    sched.handle(b)
    [(_, grant)] = wire.grants()
    sched.handle(ended(b, 30 * MS))
    assert wire.sent[-1] == (1, p.Revoke(grant_id=grant.grant_id))
    assert sched.bubbles == 1 and sched.bubble_ns == 30 * MS


def test_use_latency_and_overruns_are_accounted() -> None:
    sched, wire, latency = make()
    t = task(1, 1 * MS, sched)
    b = started(10 * MS)
    sched.handle(b)
    [(_, grant)] = wire.grants()
    sched.handle(ended(b, 8 * MS))  # the bubble ended earlier than expected
    sched.handle(done(t, grant, reason="revoked", busy=9 * MS, delay=150_000, end=b.t_ns + 9 * MS))
    # the task was busy 9 ms, but only the 8 ms inside the bubble count as bubble time used
    assert sched.used_ns == 8 * MS and t.busy_ns == 9 * MS and t.steps == 1
    assert sched.overruns == 1 and sched.overrun_ns == 1 * MS
    assert latency.count == 1 and latency.summary()[0] == 150_000


def test_a_step_ending_inside_the_bubble_is_no_overrun() -> None:
    sched, wire, _ = make()
    t = task(1, 1 * MS, sched)
    b = started(10 * MS)
    sched.handle(b)
    [(_, grant)] = wire.grants()
    sched.handle(done(t, grant, busy=5 * MS, end=b.t_ns + 5 * MS))
    sched.handle(ended(b, 10 * MS))
    assert sched.overruns == 0


def test_unknown_step_time_probes_only_at_a_bubble_start() -> None:
    sched, wire, _ = make()
    known = task(1, 1 * MS, sched)
    task(2, -1, sched)
    sched.handle(started(50 * MS))
    [(tid, grant)] = wire.grants()
    assert tid == 1
    sched.handle(done(known, grant, busy=1 * MS))  # rest of the bubble: not for the probe
    assert len(wire.grants()) == 1
    sched.handle(started(50 * MS, index=1))
    assert wire.grants()[-1][0] == 2


def test_a_task_that_becomes_runnable_mid_bubble_gets_it() -> None:
    sched, wire, _ = make()
    sched.handle(started(50 * MS))
    assert wire.grants() == []
    task(1, 1 * MS, sched)
    assert [t for t, _ in wire.grants()] == [1]


def test_a_lost_backend_revokes_and_stops_granting() -> None:
    sched, wire, _ = make()
    task(1, 1 * MS, sched)
    sched.handle(started(50 * MS))
    sched.backend_lost()
    assert isinstance(wire.sent[-1][1], p.Revoke) and not sched.alive


def test_a_task_shut_out_by_its_estimate_gets_a_probe_now_and_then() -> None:
    from freeride.serve.scheduler import PROBE_AFTER_BUBBLES

    sched, wire, _ = make()
    t = task(1, 80 * MS, sched)  # a stale estimate, larger than any bubble
    for i in range(PROBE_AFTER_BUBBLES - 1):
        b = started(20 * MS, index=i)
        sched.handle(b)
        sched.handle(ended(b, 20 * MS))
    assert wire.grants() == []
    sched.handle(started(20 * MS, index=99))
    [(_, grant)] = wire.grants()
    assert grant.probe
    t.estimate_ns = 1 * MS  # what the probe step measured
    sched.handle(done(t, grant, busy=1 * MS))
    sched.handle(started(20 * MS, index=100))
    assert not wire.grants()[-1][1].probe
