"""The scheduler and its device's interference guard: what grants carry, and what the stage's late start costs.

Driven by hand on a :class:`~freeride.clock.ManualClock`, as in test_scheduler.
"""

from __future__ import annotations

from test_scheduler import MS, FakeProgram, Harness, done

from freeride import protocol as p
from freeride.clock import ManualClock
from freeride.serve.ranks import DeviceInfo
from freeride.serve.runners import ProgramRunner
from freeride.serve.scheduler import DeviceScheduler
from freeride.serve.tasks import TaskRecord


def ended(h: Harness, start: p.BubbleStarted, duration_ns: int, *, waited_ns: int = 0) -> None:
    """The bubble ends after ``duration_ns``, of which the stage waited ``waited_ns`` for its core at the end."""
    h.clock.set(max(h.clock.now_ns(), start.t_ns + duration_ns))
    h.sched.on_bubble_ended(
        p.BubbleEnded(
            rank=0,
            stage=0,
            device="cpu:0",
            step=start.step,
            index=start.index,
            t_ns=start.t_ns + duration_ns,
            duration_ns=duration_ns,
            waited_runnable_ns=waited_ns,
        )
    )


def overrunning_bubbles(h: Harness, t: TaskRecord, n: int, *, past_end_ns: int, real_ns: int = 10 * MS) -> None:
    """``n`` bubbles announced as 10 ms that last ``real_ns``, whose step runs ``past_end_ns`` beyond the end."""
    for i in range(n):
        b = h.started(10 * MS, index=i)
        grant = h.grants()[-1][1]
        ended(h, b, real_ns)
        h.report(t, done(t, grant, reason="revoked", busy=5 * MS, end=b.t_ns + real_ns + past_end_ns))
        h.clock.advance(20 * MS - real_ns)


def test_a_grant_carries_the_margin_and_its_deadline_the_factor_of_the_guard() -> None:
    h = Harness(margin_ns=1 * MS)
    t = h.task(1, 1 * MS)
    b = h.started(10 * MS)
    grant = h.grants()[-1][1]
    assert (grant.margin_ns, grant.deadline_ns) == (1 * MS, b.t_ns + 10 * MS)
    ended(h, b, 10 * MS)
    h.report(t, done(t, grant, reason="revoked", busy=1 * MS, end=b.t_ns + 2 * MS))

    # 1 ms past the end of every 20 ms: 5 % interference, ten times the target; and the bubbles
    # end before their deadline (8 of the 10 ms announced), so the prediction is shortened too
    overrunning_bubbles(h, t, h.sched.guard.config.widen_after, past_end_ns=1 * MS, real_ns=8 * MS)
    assert h.sched.interference_ns > 0
    b = h.started(10 * MS, index=99)
    grant = h.grants()[-1][1]
    c = h.sched.guard.config
    assert grant.margin_ns == round(c.widen_by * MS)
    assert grant.deadline_ns == b.t_ns + round(10 * MS * c.widen_factor_by)  # the expected 10 ms, shortened
    status = h.sched.status(DeviceInfo(name="cpu:0", first_seen_ns=0))
    assert (status.margin_ns, status.prediction_factor) == (round(c.widen_by * MS), c.widen_factor_by)
    assert status.guard_reason.startswith("widened: interference ")


def test_a_step_that_fits_only_under_the_old_margin_is_not_granted_after_widening() -> None:
    h = Harness(margin_ns=1 * MS)
    t = h.task(1, 88 * MS // 10)  # 8.8 ms + 1 ms margin fit a 10 ms bubble
    overrunning_bubbles(h, t, h.sched.guard.config.widen_after, past_end_ns=1 * MS)
    assert len(h.grants()) == h.sched.guard.config.widen_after
    h.started(10 * MS, index=99)  # 8.8 ms + the widened 1.5 ms margin do not
    assert len(h.grants()) == h.sched.guard.config.widen_after


def test_the_stage_waiting_for_its_core_at_a_bubbles_end_is_interference_of_the_step_that_held_it() -> None:
    h = Harness()
    t = h.task(1, 5 * MS)
    b = h.started(20 * MS)
    [(_, grant)] = h.grants()
    # the stage's receive completed at 10 ms; the side step held the core 2 ms more
    ended(h, b, 12 * MS, waited_ns=2 * MS)
    h.report(t, done(t, grant, reason="revoked", busy=12 * MS, end=b.t_ns + 12 * MS))
    assert h.sched.interference_ns == 2 * MS and h.sched.task_interference_ns(1) == 2 * MS
    assert h.sched.bubble_ns == 12 * MS  # as the rank measured it
    assert h.sched.used_ns == 10 * MS  # the step's time while the stage waited for the core was not a use


def test_a_step_that_ended_before_the_stage_was_free_is_not_charged_for_its_wait() -> None:
    """The stage waited for its core (other load on the machine) after the side task had given its grant back."""
    h = Harness()
    t = h.task(1, 5 * MS)
    b = h.started(20 * MS)
    [(_, grant)] = h.grants()
    h.clock.advance(5 * MS)
    h.report(t, done(t, grant, reason="no_fit", busy=5 * MS, end=b.t_ns + 5 * MS))
    ended(h, b, 12 * MS, waited_ns=2 * MS)
    assert h.sched.interference_ns == 0
    assert h.sched.bubble_ns == 12 * MS


def test_the_stages_wait_is_charged_to_a_grant_returned_with_a_step_that_ran_into_it() -> None:
    """The grant's report can come before the bubble's end: its step's end says whether it held the core."""
    h = Harness()
    t = h.task(1, 5 * MS)
    b = h.started(20 * MS)
    [(_, grant)] = h.grants()
    h.clock.advance(11 * MS)
    h.report(t, done(t, grant, reason="no_fit", busy=11 * MS, end=b.t_ns + 11 * MS))
    ended(h, b, 12 * MS, waited_ns=2 * MS)  # free at 10 ms
    assert h.sched.interference_ns == 2 * MS


def test_the_stages_wait_makes_the_guard_widen() -> None:
    h = Harness(margin_ns=1 * MS)
    t = h.task(1, 1 * MS)
    for i in range(h.sched.guard.config.widen_after):
        b = h.started(10 * MS, index=i)
        grant = h.grants()[-1][1]
        ended(h, b, 11 * MS, waited_ns=1 * MS)  # no step ran past the end stamp: only the stage's wait
        h.report(t, done(t, grant, reason="revoked", busy=10 * MS, end=b.t_ns + 11 * MS))
        h.clock.advance(10 * MS)
    assert h.sched.overruns == 0
    assert h.sched.guard.margin_ns == round(h.sched.guard.config.widen_by * MS)


def test_a_program_stops_at_the_grants_margin() -> None:
    """The imperative runner hands the grant's margin (the guard's) to the program's deadline timer."""
    clock = ManualClock()
    program = FakeProgram(clock)
    runner = ProgramRunner(7, program, report=lambda d: None, clock=clock)
    runner.grant(p.Grant(grant_id=1, bubble_t_ns=0, deadline_ns=10 * MS, margin_ns=3 * MS))
    runner.revoke(1)
    runner.grant(p.Grant(grant_id=2, bubble_t_ns=0, deadline_ns=10 * MS))
    assert program.margins == [3 * MS, None]  # None: the program's own, from the configured margin


def test_a_stage_that_preempts_its_side_tasks_is_not_charged_for_its_wait() -> None:
    """Side tasks at nice 19 cannot hold the stage's core: a wait at the end is other load's."""
    h = Harness()
    h.sched = DeviceScheduler("cpu:0", latency=h.latency, margin_ns=0, charge_stage_waits=False, clock=h.clock)
    t = h.task(1, 5 * MS)
    b = h.started(20 * MS)
    [(_, grant)] = h.grants()
    ended(h, b, 12 * MS, waited_ns=2 * MS)
    h.report(t, done(t, grant, reason="revoked", busy=12 * MS, end=b.t_ns + 12 * MS))
    assert h.sched.interference_ns == 0 and h.sched.used_ns == 12 * MS


def test_bubbles_without_a_task_to_grant_leave_the_margin_where_it_is() -> None:
    h = Harness(margin_ns=1 * MS)
    for i in range(4 * h.sched.guard.config.narrow_after):
        b = h.started(10 * MS, index=i)
        ended(h, b, 10 * MS)
        h.clock.advance(10 * MS)
    assert h.sched.guard.margin_ns == 1 * MS
    t = h.task(1, 1 * MS)
    overrunning_bubbles(h, t, h.sched.guard.config.narrow_after, past_end_ns=0)
    # granted bubbles, none spilling: it narrows
    assert h.sched.guard.margin_ns == round(h.sched.guard.config.narrow_by * MS)
