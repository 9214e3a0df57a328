"""What the scheduler charges an armed grant: its used time and its CPU time past its bubble's end.

With armed workers the manager reads the ranks' events in batches, so it may
handle a bubble's end after the grant came back, or long after the end itself
(rig from test_scheduler_arming).
"""

from __future__ import annotations

from test_scheduler_arming import MS, ArmableRunner, Harness, _info, done

from freeride import protocol as p
from freeride.serve.tasks import TaskRecord


def test_used_time_of_an_armed_grant_starts_at_the_cpu_clock_the_worker_read_when_it_took_it() -> None:
    h = Harness()
    t1 = h.task(1, 2 * MS)
    runner = t1.runner
    assert isinstance(runner, ArmableRunner)
    runner.cpu = 9 * MS  # read by the manager when the event reached it: the worker was already stepping
    [(_, arm)] = h.arms()
    b = h.started(20 * MS)
    runner.cpu = 17 * MS  # at the bubble's end: the worker's last step ended just before
    h.ended(b, 20 * MS)
    h.report(t1, done(t1, arm.grant_id, reason="revoked", busy=12 * MS, cpu_start=5 * MS, cpu=17 * MS))
    assert h.sched.status(_info()).used_ns == 12 * MS  # 17 - 5, not 17 - 9


def _stepping(h: Harness) -> tuple[TaskRecord, ArmableRunner, int, p.BubbleStarted]:
    """Task 1 armed, its CPU clock at 0, in a bubble expected to last 20 ms: (task, runner, arm's grant, start)."""
    t1 = h.task(1, 2 * MS)
    runner = t1.runner
    assert isinstance(runner, ArmableRunner)
    runner.cpu = 0
    [(_, arm)] = h.arms()
    return t1, runner, arm.grant_id, h.started(20 * MS)


def test_an_end_handled_late_takes_wall_times_not_the_cpu_clock_read_then() -> None:
    h = Harness()
    t1, runner, grant_id, b = _stepping(h)
    h.clock.set(b.t_ns + 40 * MS)  # the end is handled 20 ms after it came
    runner.cpu = 25 * MS  # read now, this would say the last step took nothing from training
    h.ended(b, 20 * MS)
    # the step ran 3 ms past the end: by wall times that is the interference
    h.report(t1, done(t1, grant_id, reason="revoked", busy=23 * MS, cpu_start=0, cpu=23 * MS, end=b.t_ns + 23 * MS))
    assert h.sched.status(_info()).interference_ns == 3 * MS


def test_an_end_handled_after_the_report_counts_the_last_steps_cpu_past_the_end_not_its_wall_time() -> None:
    h = Harness()
    t1, _, grant_id, b = _stepping(h)
    # the last step started 4 ms before the end and ended 6 ms past it with 5 ms of CPU: it had its
    # core for the 4 ms inside, then the stage took the core back and the step ran 1 ms of its 6
    last = {"last_start": b.t_ns + 16 * MS, "cpu_last_start": 16 * MS}
    h.report(
        t1, done(t1, grant_id, reason="revoked", busy=26 * MS, cpu_start=0, cpu=21 * MS, end=b.t_ns + 26 * MS, **last)
    )
    h.clock.set(b.t_ns + 40 * MS)  # the end is handled in a batch, after the report: no clock read at the end
    h.ended(b, 20 * MS)
    assert h.sched.status(_info()).interference_ns == 1 * MS  # 5 ms of CPU less the 4 ms inside; 6 ms by wall


def test_on_a_cuda_device_wall_times_count_not_the_cpu_clock_of_a_worker_asleep_in_its_sync() -> None:
    """A worker on a GPU sleeps in a blocking sync while its step's kernels run: its CPU clock barely moves."""
    h = Harness(device="cuda:0")
    t1, _, grant_id, b = _stepping(h)
    # steps for 22 ms of which 2 ms past the end, 1.1 ms of CPU in all (their launches)
    last = {"last_start": b.t_ns + 17 * MS, "cpu_last_start": 1_000_000}
    h.report(
        t1, done(t1, grant_id, reason="revoked", busy=22 * MS, cpu_start=0, cpu=1_100_000, end=b.t_ns + 22 * MS, **last)
    )
    h.ended(b, 20 * MS)
    status = h.sched.status(_info("cuda:0"))
    assert (status.used_ns, status.interference_ns) == (20 * MS, 2 * MS)
