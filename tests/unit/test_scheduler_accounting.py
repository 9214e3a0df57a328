"""The per-device scheduler's accounts (harness from test_scheduler): bubble time used and interference
by CPU clock, training time across launches, and the typical bubble.
"""

from __future__ import annotations

from test_scheduler import MS, Harness, RecordingRunner, done

from freeride.serve.ranks import DeviceInfo
from freeride.serve.scheduler import MIN_BUBBLES_SEEN


def test_used_is_compute_inside_the_bubble_and_interference_is_compute_after_it() -> None:
    h = Harness()
    t = h.task(1, 5 * MS)
    runner = t.runner
    assert isinstance(runner, RecordingRunner)
    runner.cpu = 100 * MS
    b = h.started(20 * MS)
    [(_, grant)] = h.grants()
    runner.cpu = 108 * MS  # 8 ms of compute by the time the bubble ended at 10 ms (it waited for its core)
    h.ended(b, 10 * MS)
    # 5 ms more compute after the end
    h.report(t, done(t, grant, reason="revoked", busy=15 * MS, end=b.t_ns + 15 * MS, cpu=113 * MS))
    assert h.sched.used_ns == 8 * MS
    assert h.sched.interference_ns == 5 * MS and h.sched.task_interference_ns(1) == 5 * MS
    assert h.sched.overruns == 1 and h.sched.overrun_ns == 5 * MS  # wall time past the end, as before


def test_a_task_that_never_overruns_interferes_with_nothing() -> None:
    h = Harness()
    t = h.task(1, 2 * MS)
    runner = t.runner
    assert isinstance(runner, RecordingRunner)
    for i in range(5):
        runner.cpu = i * 10 * MS
        b = h.started(10 * MS, index=i)
        [*_, (_, grant)] = h.grants()
        h.report(t, done(t, grant, busy=6 * MS, end=b.t_ns + 6 * MS, cpu=(i * 10 + 6) * MS))
        runner.cpu = (i * 10 + 6) * MS
        h.ended(b, 10 * MS)
    assert h.sched.interference_ns == 0 and h.sched.used_ns == 30 * MS and h.sched.overruns == 0


def test_a_report_that_beats_the_bubble_end_is_charged_its_wall_time_past_the_end() -> None:
    """The end was handled after a report that does not say when its last step started: wall time stands in."""
    h = Harness()
    t = h.task(1, 5 * MS)
    runner = t.runner
    assert isinstance(runner, RecordingRunner)
    runner.cpu = 0
    b = h.started(20 * MS)
    [(_, grant)] = h.grants()
    h.report(t, done(t, grant, busy=12 * MS, end=b.t_ns + 12 * MS, cpu=12 * MS))
    h.ended(b, 9 * MS)
    assert h.sched.interference_ns == 3 * MS and h.sched.used_ns == 9 * MS


def test_train_time_runs_from_the_first_bubble_event_to_the_last() -> None:
    h = Harness()
    b = h.started(10 * MS)
    h.ended(b, 10 * MS)
    h.clock.advance(30 * MS)
    b = h.started(10 * MS, index=1)
    h.ended(b, 10 * MS)
    assert h.sched.train_ns(alive=False) == 50 * MS
    h.clock.advance(5 * MS)
    assert h.sched.train_ns(alive=True) == 55 * MS


def test_train_time_adds_up_each_launch_not_the_time_between() -> None:
    h = Harness()
    b = h.started(10 * MS)
    h.ended(b, 10 * MS)  # the first job: 10 ms
    h.sched.backend_lost()
    h.clock.advance(1000 * MS)  # nothing trains here for a second
    b = h.started(10 * MS, index=1)
    h.clock.advance(15 * MS)
    h.ended(b, 10 * MS)
    assert h.sched.train_ns(alive=False) == 20 * MS
    h.clock.advance(5 * MS)
    assert h.sched.train_ns(alive=True) == 30 * MS


def test_the_typical_bubble_comes_from_the_profile_until_enough_bubbles_ended_here() -> None:
    h = Harness()
    info = DeviceInfo(name="cpu:0", first_seen_ns=0, profiled_bubble_ns=30 * MS)
    assert h.sched.typical_bubble_ns(info) == 30 * MS
    for k in range(MIN_BUBBLES_SEEN):
        h.ended(h.started(20 * MS, step=k, index=0), 20 * MS if k % 2 else 2 * MS)
        h.clock.advance(5 * MS)
        assert h.sched.typical_bubble_ns(info) == (30 * MS if k < MIN_BUBBLES_SEEN - 1 else 20 * MS)
    assert h.sched.status(info).typical_bubble_ns == 20 * MS  # what `freeride status` shows


def test_without_a_profile_the_first_bubbles_give_the_typical_one() -> None:
    """A job without a profile has its tasks placed after its first steps: a few bubbles then, not 16."""
    h = Harness()
    info = DeviceInfo(name="cpu:0", first_seen_ns=0)
    assert h.sched.typical_bubble_ns(info) == 0  # nothing known yet
    for k, length in enumerate((25 * MS, 2 * MS, 20 * MS)):
        h.ended(h.started(20 * MS, step=0, index=k), length)
        h.clock.advance(5 * MS)
    assert h.sched.typical_bubble_ns(info) == 25 * MS
