"""Liveness on virtual time: hung steps found by the scheduler, checkpoints the gate forces or retries, backoff.

The scheduler and the gate are driven by hand with a
:class:`~freeride.clock.ManualClock`, reusing the rigs of their own unit tests.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from test_gate import MARGIN, STEP, Rig, make_rig
from test_scheduler import MS, Harness, RecordingRunner, done

from freeride import protocol as p
from freeride.serve.config import ServeConfig
from freeride.serve.liveness import SLOW_PREFIX, Liveness
from freeride.serve.tasks import TaskRecord, restart_delay_s
from freeride.transport import Endpoints

SECOND = 1_000_000_000


# -- the scheduler's hang detector hook -------------------------------------------


def test_a_grant_never_given_back_is_overdue_only_after_the_grace() -> None:
    h = Harness()
    t = h.task(1, 2 * MS)
    b = h.started(10 * MS)
    h.ended(b, 10 * MS)  # revoked; the worker never answers (a step that does not end)
    grace = 5 * SECOND
    h.clock.advance(grace)
    assert h.sched.overdue(h.clock.now_ns(), lambda task: grace) == []
    h.clock.advance(1)
    [(task, late, thawed)] = h.sched.overdue(h.clock.now_ns(), lambda task: grace)
    assert task is t and late == grace + 1 and thawed == -1  # not frozen


def test_a_grant_given_back_is_never_overdue() -> None:
    h = Harness()
    t = h.task(1, 2 * MS)
    b = h.started(10 * MS)
    [(_, grant)] = h.grants()
    h.report(t, done(t, grant, busy=2 * MS, end=b.t_ns + 2 * MS))
    h.ended(b, 10 * MS)
    h.clock.advance(100 * SECOND)
    assert h.sched.overdue(h.clock.now_ns(), lambda task: 0) == []


# Race: a hung worker does not read its socket. Before, every bubble was granted to it
# (round robin) and sat unread while the healthy task beside it waited for the bubble.
def test_a_task_stuck_in_a_step_gets_no_further_grants_and_the_healthy_one_does() -> None:
    h = Harness()
    stuck = h.task(1, 2 * MS)
    healthy = h.task(2, 2 * MS)
    b = h.started(10 * MS)
    [(tid, _)] = h.grants()
    assert tid == stuck.task_id
    h.ended(b, 10 * MS)
    h.sent.clear()
    for i in range(5):  # bubble after bubble: only the healthy task is granted
        h.clock.advance(5 * MS)
        b = h.started(10 * MS, index=i + 1)
        [(tid, grant)] = h.grants()
        assert tid == healthy.task_id
        h.report(healthy, done(healthy, grant, reason="revoked", busy=2 * MS, end=b.t_ns + 2 * MS))
        h.ended(b, 10 * MS)
        h.sent.clear()


# Seen in a 2-stage DeepSpeed job: a step overran a bubble's end, the stage preempted it for its
# own compute (10 ms), and the worker finished it 2 ms into the next bubble. That bubble's start
# passed it over as still in a step, its report ("revoked") granted nothing, and 18-20 ms went
# unused, in 4-8 % of stage 1's bubble time.
def test_a_bubble_passed_over_while_its_task_was_still_in_a_step_is_granted_once_it_is_back() -> None:
    h = Harness()
    t = h.task(1, 1 * MS)
    a = h.started(30 * MS)
    [(_, first)] = h.grants()
    h.ended(a, 30 * MS)  # revoked; the step in flight does not end before the next bubble
    h.clock.advance(10 * MS)
    b = h.started(20 * MS, index=1)
    assert len(h.grants()) == 1  # passed over: its worker would not read a grant now
    h.clock.advance(2 * MS)
    h.report(t, done(t, first, reason="revoked", busy=29 * MS, end=h.clock.now_ns()))
    [_, (tid, second)] = h.grants()
    assert tid == t.task_id and second.bubble_t_ns == b.t_ns and second.deadline_ns == b.t_ns + 20 * MS
    h.report(t, done(t, second, reason="revoked", busy=17 * MS, end=b.t_ns + 19 * MS))
    h.ended(b, 20 * MS)
    assert len(h.grants()) == 2  # back in its own bubble: nothing more to offer


def test_a_report_from_an_earlier_bubble_does_not_grant_a_bubble_someone_holds() -> None:
    h = Harness()
    slow, other = h.task(1, 1 * MS), h.task(2, 1 * MS)
    a = h.started(30 * MS)
    [(tid, first)] = h.grants()
    assert tid == slow.task_id
    h.ended(a, 30 * MS)
    h.clock.advance(10 * MS)
    b = h.started(20 * MS, index=1)
    [_, (tid, held)] = h.grants()
    assert tid == other.task_id and held.bubble_t_ns == b.t_ns
    h.report(slow, done(slow, first, reason="revoked", busy=29 * MS, end=h.clock.now_ns()))
    assert len(h.grants()) == 2  # the bubble has its holder


def test_forget_drops_a_killed_workers_grants() -> None:
    h = Harness()
    t = h.task(1, 2 * MS)
    b = h.started(10 * MS)
    h.ended(b, 10 * MS)
    h.sched.forget(t)
    h.clock.advance(100 * SECOND)
    assert h.sched.overdue(h.clock.now_ns(), lambda task: 0) == []


# -- slow or hung: the liveness check -------------------------------------------------

HANG_AFTER = 2 * SECOND


def watched(h: Harness) -> tuple[Liveness, list[TaskRecord]]:
    """A liveness check over the harness's scheduler (its period: 0.5 s of virtual time)."""
    config = ServeConfig(
        endpoints=Endpoints.ipc(Path("/nonexistent")),
        state_dir=Path("/nonexistent/state"),
        hang_after_s=HANG_AFTER / SECOND,
    )
    notified: list[TaskRecord] = []
    return Liveness(config, {"cpu:0": h.sched}, notify=notified.append, clock=h.clock), notified


def overrun(h: Harness, t: TaskRecord, *, cpu_per_look: int) -> tuple[Liveness, p.Grant]:
    """``t`` takes a bubble and its step goes on past the grace; the check looks twice."""
    live, _ = watched(h)
    runner = t.runner
    assert isinstance(runner, RecordingRunner)
    runner.cpu = 0
    b = h.started(10 * MS)
    [(_, grant)] = h.grants()
    h.ended(b, 10 * MS)
    h.clock.advance(HANG_AFTER + 1)
    live.check()  # the first look only notes the CPU clock
    assert t.hangs == 0 and not t.slow
    h.clock.advance(SECOND // 2)
    runner.cpu += cpu_per_look
    live.check()
    return live, grant


def test_a_step_still_computing_past_its_grace_is_slow_it_runs_on_in_bubbles_only_and_alone() -> None:
    h = Harness()
    t, other = h.task(1, 2 * MS), h.task(2, 2 * MS)
    runner = t.runner
    assert isinstance(runner, RecordingRunner)
    live, grant = overrun(h, t, cpu_per_look=SECOND // 4)  # half a core between the looks
    assert t.slow and t.hangs == 0 and t.error.startswith(SLOW_PREFIX), t.error
    assert runner.frozen  # frozen at once: no bubble lasts now
    h.sent.clear()
    b = h.started(10 * MS, index=1)
    assert not runner.frozen and h.grants() == []  # it has the bubble to itself
    h.ended(b, 10 * MS)
    assert runner.frozen
    c = h.started(10 * MS, index=2)
    h.clock.advance(3 * MS)
    h.report(t, done(t, grant, reason="revoked", busy=3 * MS, end=h.clock.now_ns()))  # the step ended
    assert not runner.frozen
    [(tid, left)] = h.grants()
    assert tid == other.task_id  # what is left of the bubble goes to the others again
    live.check()
    assert t.error == ""  # the note went with the step
    h.report(other, done(other, left, reason="revoked", busy=2 * MS, end=h.clock.now_ns() + 2 * MS))
    h.ended(c, 10 * MS)
    # its next overrun is frozen at the bubble's end at once, not a grace later
    h.sent.clear()
    d = h.started(10 * MS, index=3)
    assert [tid for tid, _ in h.grants()] == [t.task_id]  # its turn
    h.ended(d, 10 * MS)
    assert runner.frozen


def test_a_step_past_its_grace_that_does_not_compute_is_hung() -> None:
    h = Harness()
    t = h.task(1, 2 * MS)
    overrun(h, t, cpu_per_look=0)
    assert t.hangs == 1 and not t.slow and not t.runnable and not t.final
    assert "not computing" in t.error and "restarts from its checkpoint" in t.error, t.error


def test_a_task_that_hangs_again_from_the_same_checkpoint_is_not_restarted() -> None:
    h = Harness()
    t = h.task(1, 2 * MS)
    t.checkpointed_steps = 40
    t.hang_checkpoint = 40  # it hung before, and has written no checkpoint since
    overrun(h, t, cpu_per_look=0)
    assert t.hangs == 1 and t.final
    assert "not restarted: it hung before, from the same state (its checkpoint at step 40)" in t.error, t.error


def test_a_frozen_step_that_stops_computing_is_hung_after_a_grace_of_its_own_bubble_time() -> None:
    h = Harness()
    t = h.task(1, 2 * MS)
    runner = t.runner
    assert isinstance(runner, RecordingRunner)
    live, _ = overrun(h, t, cpu_per_look=SECOND // 4)
    assert t.slow and runner.frozen
    index = 1
    # no bubbles: however long, a frozen step that is not let run is not hung
    h.clock.advance(10 * HANG_AFTER)
    live.check()
    live.check()
    assert t.hangs == 0
    while t.hangs == 0 and index < 2000:  # bubbles of 10 ms in which it computes nothing
        b = h.started(10 * MS, index=index)
        h.clock.advance(10 * MS)
        h.ended(b, 10 * MS)
        h.clock.advance(10 * MS)
        live.check()
        index += 1
    assert t.hangs == 1 and "not computing" in t.error
    assert HANG_AFTER // (10 * MS) <= index <= HANG_AFTER // (10 * MS) + 2  # a grace of bubble time


# -- restart backoff -----------------------------------------------------------------


def test_restart_delay_doubles_and_is_bounded() -> None:
    delays = [restart_delay_s(n, base_s=0.5, max_s=3.0) for n in range(0, 7)]
    assert delays == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert restart_delay_s(10_000, base_s=1.0, max_s=60.0) == 60.0  # no overflow


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("hang_after_s", 0.0),
        ("hang_factor", -1.0),
        ("restart_backoff_s", 0.0),
        ("restart_backoff_max_s", 0.1),
        ("max_loss_s", -1.0),
        ("max_loss_steps", -1),
    ],
)
def test_liveness_config_is_validated(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        ServeConfig(endpoints=Endpoints.ipc(Path("/tmp/x")), state_dir=Path("/tmp/x"), **{field: value})  # type: ignore[arg-type]


# -- checkpoints that always happen ------------------------------------------------------


async def given_back(rig: Rig, grant_id: int) -> None:
    """Let the gate run until it has given grant ``grant_id`` back (bounded: no sleeps, no hang)."""
    for _ in range(1000):
        if any(d.grant_id == grant_id for d in rig.link.done()):
            return
        await asyncio.sleep(0)
    raise AssertionError(f"grant {grant_id} was never given back")


def bounded(rig: Rig, **bounds: int) -> Rig:
    rig.gate._assign = msgspec.structs.replace(rig.gate._assign, **bounds)
    return rig


async def test_a_checkpoint_that_fits_no_bubble_is_forced_at_a_bubble_start_by_the_step_bound(tmp_path: Path) -> None:
    rig = bounded(make_rig(tmp_path, save_ns=500 * MS), max_loss_steps=3)
    rig.gate.checkpoint()  # learns that a save takes 500 ms: no bubble here is that long
    for grant_id in range(1, 4):
        rig.link.push(rig.grant(grant_id, STEP + MARGIN))
        await rig.step()
    assert rig.gate.unsaved_steps == 3 and rig.saver.saved_at_steps == [0]
    # the 4th step would leave 4 unsaved: the next grant starts with the checkpoint (and
    # overruns its bubble with it), the step waits for the one after
    stepping = asyncio.create_task(rig.step())
    await rig.link.parked()
    rig.link.push(rig.grant(4, STEP + MARGIN))
    await given_back(rig, 4)
    assert rig.saver.saved_at_steps == [0, 3]
    assert rig.link.done_brief()[-1] == (4, "no_fit", 0)
    assert rig.link.done()[-1].busy_ns == 500 * MS
    rig.link.push(rig.grant(5, STEP + MARGIN))
    await stepping
    assert rig.gate.unsaved_steps == 1


async def test_the_time_bound_counts_step_time_since_the_last_checkpoint(tmp_path: Path) -> None:
    rig = bounded(make_rig(tmp_path, save_ns=500 * MS), max_loss_ns=25 * MS)
    rig.gate.checkpoint()
    for grant_id in (1, 2):
        rig.link.push(rig.grant(grant_id, STEP + MARGIN))
        await rig.step()  # 10 ms each: 20 ms unsaved, a third would make 30 > 25
    stepping = asyncio.create_task(rig.step())
    await rig.link.parked()
    rig.link.push(rig.grant(3, STEP + MARGIN))
    await given_back(rig, 3)
    assert rig.saver.saved_at_steps == [0, 2]
    rig.link.push(rig.grant(4, STEP + MARGIN))
    await stepping


async def test_a_bound_reached_mid_grant_gives_the_grant_back_rather_than_step_on(tmp_path: Path) -> None:
    rig = bounded(make_rig(tmp_path, save_ns=500 * MS), max_loss_steps=1)
    rig.gate.checkpoint()
    rig.link.push(rig.grant(1, 3 * STEP + MARGIN))
    await rig.step()
    stepping = asyncio.create_task(rig.step())
    await rig.link.parked()  # no second step in this grant: it would leave 2 unsaved
    assert rig.link.done_brief() == [(1, "no_fit", 1)]
    rig.link.push(rig.grant(2, STEP + MARGIN))
    await given_back(rig, 2)
    assert rig.saver.saved_at_steps == [0, 1]
    rig.link.push(rig.grant(3, STEP + MARGIN))
    await stepping


class FullDisk:
    """A checkpoint writer on a full disk, as torch.save fails there, until space is freed."""

    def __init__(self, rig: Rig) -> None:
        self.full = True
        self.inner = rig.saver

    def __call__(self, task: object, path: Path, steps: int) -> bool:
        if self.full:
            raise RuntimeError("[enforce fail at inline_container.cc:595] . basic_ios::clear: iostream error")
        return self.inner(task, path, steps)  # type: ignore[arg-type]


async def test_a_failed_checkpoint_is_reported_the_task_goes_on_and_it_is_retried(tmp_path: Path) -> None:
    rig = bounded(make_rig(tmp_path, checkpoint_every_ns=100 * MS), max_loss_steps=2)
    disk = FullDisk(rig)
    rig.gate._checkpoints.save = disk
    assert rig.gate.checkpoint() is False
    [failed] = [m for m in rig.link.sent if isinstance(m, p.CheckpointFailed)]
    assert "basic_ios::clear" in failed.error and failed.steps == 0
    # the task steps on: the bound is not enforced while writes fail (that would stall it)
    for grant_id in range(1, 5):
        rig.link.push(rig.grant(grant_id, STEP + MARGIN))
        await rig.step()
    assert rig.gate.steps == 4
    disk.full = False  # space freed: the next attempt, after the retry delay, succeeds
    rig.clock.advance(100 * MS)
    stepping = asyncio.create_task(rig.step())
    await rig.link.parked()
    rig.link.push(rig.grant(5, 10 * STEP))
    await stepping
    assert rig.saver.saved_at_steps == [4]
    assert rig.gate.unsaved_steps == 1
    assert [m.steps for m in rig.link.sent if isinstance(m, p.Checkpointed)] == [4]
