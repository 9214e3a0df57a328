"""The per-device scheduler's armed grants: who is armed, when an arm is honoured, what it is charged.

Driven by hand, as the events loop and the supervisor call it, with a
:class:`~freeride.clock.ManualClock` and runners that record what they are told.
"""

from __future__ import annotations

from pathlib import Path

from freeride import protocol as p
from freeride.clock import ManualClock
from freeride.holdback import granted
from freeride.observe.stats import LatencyRecorder
from freeride.serve.costs import TrainingCosts
from freeride.serve.ranks import DeviceInfo
from freeride.serve.scheduler import DeviceScheduler
from freeride.serve.tasks import TaskRecord

MS = 1_000_000
ENDPOINT = "ipc:///run/fr/bubbles-0"


class ArmableRunner:
    """A worker's runner without a worker: records what it is told; arms are accepted unless told not to."""

    pid = 4242
    alive = True

    def __init__(self, task_id: int, sent: list[tuple[int, p.ManagerToWorker]], *, armable: bool = True) -> None:
        self.task_id, self.sent, self.armable = task_id, sent, armable
        self.cpu = -1

    def cpu_ns(self) -> int:
        return self.cpu

    def cpu_at_grant(self) -> int:
        return self.cpu

    def grant(self, grant: p.Grant) -> bool:
        self.sent.append((self.task_id, grant))
        return True

    def arm(self, arm: p.Arm) -> bool:
        if self.armable:
            self.sent.append((self.task_id, arm))
        return self.armable

    def disarm(self, grant_id: int) -> None:
        self.sent.append((self.task_id, p.Disarm(grant_id=grant_id)))

    def revoke(self, grant_id: int) -> None:
        self.sent.append((self.task_id, p.Revoke(grant_id=grant_id)))

    def stop(self, reason: str) -> None:
        self.sent.append((self.task_id, p.Stop(reason=reason)))


class Harness:
    def __init__(self, *, endpoint: str = ENDPOINT, device: str = "cpu:0") -> None:
        self.device = device
        self.clock = ManualClock()
        self.latency = LatencyRecorder()
        self.sent: list[tuple[int, p.ManagerToWorker]] = []
        self.sched = DeviceScheduler(device, latency=self.latency, margin_ns=0, clock=self.clock)
        self.sched.follow_rank(endpoint)

    def of(self, kind: type[p.Disarm] | type[p.Revoke]) -> list[tuple[int, object]]:
        return [(t, m) for t, m in self.sent if isinstance(m, kind)]

    def arms(self) -> list[tuple[int, p.Arm]]:
        return [(t, m) for t, m in self.sent if isinstance(m, p.Arm)]

    def grants(self) -> list[tuple[int, p.Grant]]:
        return [(t, m) for t, m in self.sent if isinstance(m, p.Grant)]

    def task(
        self, task_id: int, estimate_ns: int, *, armable: bool = True, fill: bool = False, program: bool = False
    ) -> TaskRecord:
        spec = p.ProgramSpec(argv=["prog"]) if program else p.IterativeSpec(target="m:C", fill=fill)
        t = TaskRecord(
            task_id=task_id,
            spec=spec,
            name=f"t{task_id}",
            checkpoint_path=Path("/x"),
        )
        t.place(self.device)
        t.runner = ArmableRunner(task_id, self.sent, armable=armable)
        t.ready(estimate_ns=estimate_ns)
        self.sched.on_task_changed(t)
        return t

    def report(self, t: TaskRecord, d: p.GrantDone) -> None:
        t.account(d)
        self.sched.on_grant_done(t, d)

    def started(self, expected_ns: int, *, step: int = 0, index: int = 0) -> p.BubbleStarted:
        ev = p.BubbleStarted(
            rank=0,
            stage=0,
            device=self.device,
            step=step,
            index=index,
            t_ns=self.clock.now_ns(),
            expected_ns=expected_ns,
        )
        self.sched.on_bubble_started(ev)
        return ev

    def ended(self, start: p.BubbleStarted, duration_ns: int) -> None:
        self.clock.set(max(self.clock.now_ns(), start.t_ns + duration_ns))
        self.sched.on_bubble_ended(
            p.BubbleEnded(
                rank=0,
                stage=0,
                device=self.device,
                step=start.step,
                index=start.index,
                t_ns=start.t_ns + duration_ns,
                duration_ns=duration_ns,
            )
        )


def done(
    t: TaskRecord,
    grant_id: int,
    *,
    reason: p.GrantDoneReason = "no_fit",
    busy: int = 0,
    delay: int = 100,
    armed: bool = True,
    cpu_start: int = -1,
    cpu: int = -1,
    end: int = 0,
    last_start: int = 0,
    cpu_last_start: int = -1,
) -> p.GrantDone:
    return p.GrantDone(
        task_id=t.task_id,
        grant_id=grant_id,
        steps=1 if busy else 0,
        busy_ns=busy,
        first_step_delay_ns=delay if busy else -1,
        overrun_ns=0,
        reason=reason,
        step_estimate_ns=t.estimate_ns,
        last_step_end_ns=end,
        cpu_ns=cpu,
        armed=armed,
        cpu_at_start_ns=cpu_start,
        last_step_start_ns=last_start,
        cpu_at_last_step_ns=cpu_last_start,
    )


def test_a_task_is_armed_between_bubbles_and_holds_the_next_one_without_another_choice() -> None:
    h = Harness()
    t1 = h.task(1, 2 * MS)
    [(tid, arm)] = h.arms()  # armed as soon as it is ready, before any bubble
    assert (tid, arm.endpoint, arm.after_ns) == (1, ENDPOINT, 0)
    h.clock.advance(5 * MS)
    b = h.started(20 * MS)
    # the same grant, sent as the fallback of a worker that missed the rank's event
    [(tid, grant)] = h.grants()
    assert (tid, grant.grant_id, grant.bubble_t_ns, grant.deadline_ns) == (1, arm.grant_id, b.t_ns, b.t_ns + 20 * MS)
    h.ended(b, 20 * MS)
    assert h.of(p.Revoke) == [(1, p.Revoke(grant_id=arm.grant_id))]
    # and the next bubble is armed at this one's end, after this one's start
    [_, (tid, again)] = h.arms()
    assert (tid, again.after_ns) == (1, b.t_ns) and again.grant_id != arm.grant_id
    h.report(t1, done(t1, arm.grant_id, reason="revoked", busy=15 * MS, delay=200_000, end=b.t_ns + 16 * MS))
    status = h.sched.status(_info())
    assert (status.used_ns, status.armed_grants, status.overruns) == (15 * MS, 1, 0)
    assert h.latency.values() == [200_000]


def test_an_armed_task_that_does_not_fit_passes_the_bubble_on_as_a_fresh_one() -> None:
    h = Harness()
    t1 = h.task(1, 30 * MS)
    t2 = h.task(2, 2 * MS)
    [(tid, arm)] = h.arms()
    assert tid == 1  # first in turn; only one task is armed at a time
    b = h.started(20 * MS)
    assert [t for t, _ in h.grants()] == [1]
    h.report(t1, done(t1, arm.grant_id))  # no_fit, no step
    [_, (tid, grant)] = h.grants()
    assert (tid, grant.deadline_ns) == (2, b.t_ns + 20 * MS)
    h.report(t2, done(t2, grant.grant_id, reason="revoked", busy=10 * MS, armed=False))
    h.ended(b, 20 * MS)
    assert h.sched.status(_info()).armed_grants == 0  # the armed task ran nothing


def test_a_report_that_overtakes_its_bubble_start_waits_for_it_instead_of_holding_the_device() -> None:
    # The worker saw the rank's event, found no fit and answered before the same event
    # reached the manager. Were the report dropped, the grant would stay out for good.
    h = Harness()
    t1 = h.task(1, 30 * MS)
    t2 = h.task(2, 2 * MS)
    [(_, arm)] = h.arms()
    h.report(t1, done(t1, arm.grant_id))
    b = h.started(20 * MS)
    assert [t for t, _ in h.grants()] == [2]  # no Grant for the armed task: it has answered
    [(_, grant)] = h.grants()
    h.report(t2, done(t2, grant.grant_id, reason="revoked", busy=10 * MS, armed=False))
    h.ended(b, 20 * MS)
    assert h.sched.overdue(h.clock.now_ns() + 10**12, lambda task: 0) == []


def test_a_task_that_stops_being_runnable_is_disarmed_and_the_bubble_goes_the_two_hop_way() -> None:
    h = Harness()
    t1 = h.task(1, 2 * MS)
    h.task(2, 2 * MS)
    [(_, arm)] = h.arms()
    t1.request_stop()
    h.sched.on_task_changed(t1)
    assert h.of(p.Disarm) == [(1, p.Disarm(grant_id=arm.grant_id))]
    assert [t for t, _ in h.arms()] == [1, 2]  # the next in turn is armed instead
    h.started(20 * MS)
    assert [t for t, _ in h.grants()] == [2]


def test_no_arm_without_a_rank_that_publishes_its_bubbles() -> None:
    h = Harness(endpoint="")  # a rank over tcp, or an older one
    h.task(1, 2 * MS)
    assert h.arms() == []
    h.started(20 * MS)
    assert [t for t, _ in h.grants()] == [1]


def test_a_lost_rank_disarms() -> None:
    h = Harness()
    h.task(3, 2 * MS)
    [(tid, arm)] = h.arms()
    assert tid == 3
    h.sched.backend_lost()
    assert h.of(p.Disarm) == [(3, p.Disarm(grant_id=arm.grant_id))]
    assert h.sched.bubbles_endpoint == ""


def _info(device: str = "cpu:0") -> DeviceInfo:
    return DeviceInfo(name=device, first_seen_ns=0)


def test_bubbles_held_by_armed_grants_count_as_used_for_the_guard() -> None:
    """The guard narrows only over bubbles side work was granted in: an honoured arm is such a grant."""
    h = Harness()
    h.sched.guard.min_bubble_ns = 0  # no class left out to let back in: narrowing ends at "narrowest"
    t1 = h.task(1, 2 * MS)
    for _ in range(60):
        arm = h.arms()[-1][1]
        ev = h.started(20 * MS)
        h.ended(ev, 20 * MS)
        h.report(t1, done(t1, arm.grant_id, reason="revoked", busy=15 * MS, end=ev.t_ns + 16 * MS))
    # every bubble went by an arm: a fallback Grant for the first only (then its reports say it hears the rank)
    assert [t for t, _ in h.grants()] == [1]
    assert h.sched.status(_info()).armed_grants == 60
    # with no interference the guard narrows, down to its floor (no margin here): only over granted bubbles
    assert h.sched.guard.reason.startswith("narrowest")


def test_a_bubble_the_guard_leaves_out_gets_no_grant_and_the_armed_task_waits_for_the_next() -> None:
    h = Harness()
    t1 = h.task(1, 1 * MS)
    h.task(2, 1 * MS, armable=False)  # one that only a Grant reaches
    [(_, arm)] = h.arms()
    h.sched.guard.min_bubble_ns = 4 * MS  # as the guard sets it once short bubbles proved too costly
    short = h.started(3 * MS)
    h.ended(short, 3 * MS)
    assert h.grants() == [] and h.of(p.Revoke) == [] and h.of(p.Disarm) == []
    assert len(h.arms()) == 1  # the arm stands
    status = h.sched.status(_info())
    assert (status.left_out, status.min_bubble_ns) == (1, 4 * MS)
    long = h.started(20 * MS)
    [(tid, grant)] = h.grants()
    assert (tid, grant.grant_id, grant.bubble_t_ns) == (1, arm.grant_id, long.t_ns)
    h.ended(long, 20 * MS)
    h.report(t1, done(t1, arm.grant_id, reason="revoked", busy=15 * MS, end=long.t_ns + 16 * MS))
    assert h.sched.status(_info()).left_out == 1


def test_short_bubbles_that_overrun_are_left_out_by_the_guard_and_the_next_arm_says_so() -> None:
    """Settled grants feed the guard by their bubble's expected length (3 ms ones overrun, 40 ms ones do not)."""
    h = Harness()
    h.sched.guard.min_bubble_ns = 0  # every bubble granted, as once the short ones were let back in
    t1 = h.task(1, 1 * MS)
    for i in range(200):
        length = 3 * MS if i % 2 else 40 * MS
        arm = h.arms()[-1][1]
        ev = h.started(length)
        if h.sched.guard.min_bubble_ns > length:
            h.ended(ev, length)
            continue
        late = 1 * MS if length == 3 * MS else 0
        h.ended(ev, length)
        h.report(t1, done(t1, arm.grant_id, reason="revoked", busy=length, end=ev.t_ns + length + late))
        if h.sched.guard.min_bubble_ns:
            break
    assert h.sched.guard.min_bubble_ns == 4 * MS, h.sched.guard.reason
    assert h.sched.guard.reason.startswith("short bubbles left out")
    assert h.arms()[-1][1].min_bubble_ns == 4 * MS  # the next arm carries it to the worker


def _bubble(h: Harness, step: int, index: int, length_ns: int = 20 * MS) -> tuple[p.BubbleStarted, list[object]]:
    """Bubble ``index`` of ``step``, from start to end; what the scheduler sent meanwhile."""
    before = len(h.sent)
    ev = h.started(length_ns, step=step, index=index)
    sent = [m for _, m in h.sent[before:]]
    h.ended(ev, length_ns)
    return ev, sent


def _budgeted() -> tuple[TrainingCosts, Harness, TaskRecord]:
    """A device whose rank trains in job ``job-7``, under a 0.5 % slowdown budget, with one task armed."""
    costs = TrainingCosts(p.Holdback(block_steps=2, every=4, max_every=4), budget=0.005)
    costs.hello(0, "job-7")
    h = Harness()
    h.sched = DeviceScheduler("cpu:0", latency=h.latency, margin_ns=0, clock=h.clock, costs=costs)
    h.sched.follow_rank(ENDPOINT)
    return costs, h, h.task(1, 2 * MS)


def test_an_arm_carries_the_jobs_held_back_steps_and_the_share_of_bubbles_its_budget_grants() -> None:
    costs, h, t1 = _budgeted()
    [(_, arm)] = h.arms()
    assert arm.holdback == p.Holdback(job="job-7", block_steps=2, every=4, max_every=4)
    assert arm.harvest_share == 1.0
    # twelve pairs whose cost lies wholly above the budget: harvesting backs off
    for step in range(2, 2 + 12 * 8):
        costs.step_finished(0, step, 150_000_000 if costs.withheld(0, step, 0) != "held_back" else 100_000_000)
    share = costs.harvest_share(0)
    assert 0.0 < share < 1.0 and costs.status()[0].harvest_share == share
    # the arm out carries the old share: its worker may take the next bubble, which is honoured, and
    # at that bubble's end the task is armed again with the share that holds now
    bubbles = [(s, i) for s in range(200, 400) for i in range(2) if costs.withheld(0, s, i) != "held_back"]
    left_out = [(s, i) for s, i in bubbles if not granted(share, s, i)]
    kept = [(s, i) for s, i in bubbles if granted(share, s, i)]
    assert left_out and kept
    _, sent = _bubble(h, *left_out[0])
    assert [type(m) for m in sent] == [p.Grant]  # honoured: the fallback Grant of a worker not yet heard
    h.report(t1, done(t1, arm.grant_id, reason="revoked", busy=MS))
    [*_, (_, rearmed)] = h.arms()
    assert rearmed.grant_id != arm.grant_id and rearmed.harvest_share == share
    # a bubble the budget leaves out goes to no one, and the arm stays out for the next one
    for step, index in left_out[1:4]:
        _, sent = _bubble(h, step, index)
        assert sent == [], (step, index)  # no Grant, no Disarm, no new Arm
    used = h.sched.status(_info()).used_ns
    # a bubble the budget grants is the armed worker's (it hears the rank: no fallback Grant)
    ev, sent = _bubble(h, *kept[0])
    assert sent == []
    h.report(t1, done(t1, rearmed.grant_id, reason="revoked", busy=3 * MS, end=ev.t_ns + 5 * MS))
    assert h.sched.status(_info()).used_ns == used + 3 * MS  # settled as the bubble's grant
    assert h.arms()[-1][1].grant_id > rearmed.grant_id  # and the next arm is out


def test_an_arm_with_a_smaller_share_than_now_is_withdrawn_at_a_bubble_it_leaves_out_and_the_bubble_granted() -> None:
    costs, h, t1 = _budgeted()
    step = 2
    while costs.harvest_share(0) == 1.0:  # pairs wholly above the budget: harvesting backs off
        costs.step_finished(0, step, 150_000_000 if costs.withheld(0, step, 0) != "held_back" else 100_000_000)
        step += 1
    share = costs.harvest_share(0)
    [(_, first)] = h.arms()
    _bubble(h, step, 0)  # the arm out is honoured; at the bubble's end the task is armed again, with the share now
    h.report(t1, done(t1, first.grant_id, reason="revoked", busy=MS))
    [*_, (_, arm)] = h.arms()
    assert arm.harvest_share == share < 1.0
    while costs.harvest_share(0) < 1.0:  # pairs at no cost: it steps back up
        costs.step_finished(0, step, 100_000_000)
        step += 1
    step, index = next((s, i) for s in range(step, step + 100) for i in range(2) if not granted(share, s, i))
    assert costs.withheld(0, step, index) == ""  # granted now, left out by the arm's share
    _, sent = _bubble(h, step, index)
    # the worker lets this bubble pass by the share it carries: its arm is withdrawn and the bubble granted
    disarm, grant = sent[:2]
    assert disarm == p.Disarm(grant_id=arm.grant_id)
    assert isinstance(grant, p.Grant) and grant.grant_id > arm.grant_id
    h.report(t1, done(t1, grant.grant_id, reason="revoked", busy=MS, armed=False))
    assert h.arms()[-1][1].harvest_share == 1.0  # once it is back, armed again with the share that holds now


def test_a_worker_that_hears_the_rank_gets_no_fallback_grant_until_the_rank_or_the_worker_changes() -> None:
    h = Harness()
    t1 = h.task(1, 2 * MS)
    runner = t1.runner
    assert isinstance(runner, ArmableRunner)

    def bubble() -> list[tuple[int, p.Grant]]:
        [*_, (_, arm)] = h.arms()
        before = len(h.grants())
        b = h.started(20 * MS)
        h.clock.advance(20 * MS)
        h.ended(b, 20 * MS)
        h.report(t1, done(t1, arm.grant_id, reason="revoked", busy=10 * MS, end=b.t_ns + 12 * MS))
        h.clock.advance(5 * MS)
        return h.grants()[before:]

    assert len(bubble()) == 1  # not known yet to hear the rank: the fallback goes
    assert bubble() == []  # its armed report says it took the rank's event
    assert h.sched.status(_info()).used_ns == 20 * MS  # both grants settled as the worker reported them
    runner.pid = 4343  # a new worker for the task
    assert len(bubble()) == 1
    assert bubble() == []
    h.sched.follow_rank("ipc:///run/fr/bubbles-1")  # another rank trains here now
    assert len(bubble()) == 1


def test_a_worker_that_missed_the_event_without_a_fallback_gives_the_grant_back_unused() -> None:
    """What the worker sends then, a report with no step at the Revoke: tests/unit/test_gate_armed.py,
    test_a_revoke_for_an_arm_whose_bubble_never_came_is_answered."""
    h = Harness()
    t1 = h.task(1, 2 * MS)
    [(_, first)] = h.arms()
    b = h.started(20 * MS)
    h.ended(b, 20 * MS)
    h.report(t1, done(t1, first.grant_id, reason="revoked", busy=10 * MS, end=b.t_ns + 12 * MS))
    [_, (_, arm)] = h.arms()
    b = h.started(20 * MS)
    assert len(h.grants()) == 1  # none for this bubble
    h.ended(b, 20 * MS)
    assert h.of(p.Revoke)[-1] == (1, p.Revoke(grant_id=arm.grant_id))
    h.report(t1, done(t1, arm.grant_id, reason="revoked", armed=False))  # unheld: nothing ran
    [*_, (_, again)] = h.arms()
    assert again.grant_id != arm.grant_id and h.sched.status(_info()).used_ns == 10 * MS


def test_a_bubble_given_back_arms_the_next_at_once_and_no_decision_waits_on_its_end() -> None:
    h = Harness()
    t1 = h.task(1, 2 * MS)
    assert h.sched.edge_due  # not known yet to hear the rank: the Grant at the start must reach it
    [(_, first)] = h.arms()
    b = h.started(20 * MS)
    h.report(t1, done(t1, first.grant_id, busy=10 * MS, end=b.t_ns + 12 * MS))  # no_fit: given back early
    [_, (_, arm)] = h.arms()  # the next bubble is armed inside this one, not at its end
    assert arm.after_ns == b.t_ns
    assert not h.sched.edge_due  # the worker hears the rank: nothing waits on this bubble's end
    h.ended(b, 20 * MS)
    assert len(h.arms()) == 2 and h.of(p.Revoke) == []
    b = h.started(20 * MS)
    assert not h.sched.edge_due and len(h.grants()) == 1  # held by the armed worker: no fallback Grant
    h.clock.advance(30 * MS)  # the manager reads the end late, in a batch
    h.ended(b, 20 * MS)
    assert h.of(p.Revoke) == [(1, p.Revoke(grant_id=arm.grant_id))]  # still out: it answers when it reads it
    h.report(t1, done(t1, arm.grant_id, reason="revoked", busy=18 * MS, end=b.t_ns + 19 * MS))
    assert h.sched.status(_info()).used_ns == 28 * MS


def test_a_program_or_a_task_that_cannot_be_armed_keeps_the_edges_due() -> None:
    h = Harness()
    assert not h.sched.edge_due  # no side work here: bubbles are only counted
    h.task(1, -1)  # its step time unknown: it probes at a bubble's start, on the scheduler's Grant
    assert h.sched.edge_due and h.arms() == []
    h2 = Harness()
    h2.task(1, 2 * MS, program=True)
    assert h2.sched.edge_due
