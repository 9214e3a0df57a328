"""The per-device scheduler: who gets each bubble, and what it is charged.

Driven by hand, as the events loop and the supervisor call it, with a
:class:`~freeride.clock.ManualClock` and runners that record what they are told.

The harness (``Harness``, ``RecordingRunner``, ``done``) is shared: other test
modules import it from here.
"""

from __future__ import annotations

from pathlib import Path

from freeride import protocol as p
from freeride.clock import ManualClock
from freeride.observe.stats import LatencyRecorder
from freeride.serve.runners import ProgramRunner
from freeride.serve.scheduler import PROBE_AFTER_BUBBLES, DeviceScheduler
from freeride.serve.tasks import TaskRecord

MS = 1_000_000


class RecordingRunner:
    """A worker's runner without a worker: records grants and revokes."""

    pid = 4242
    alive = True

    def __init__(self, task_id: int, sent: list[tuple[int, p.ManagerToWorker]]) -> None:
        self.task_id, self.sent = task_id, sent
        self.cpu = -1
        """The task's CPU clock as the manager would read it (-1: unreadable, wall times stand in)."""
        self.frozen = False
        """As the last hold left it (a slow step frozen between bubbles)."""

    def cpu_ns(self) -> int:
        return self.cpu

    def cpu_at_grant(self) -> int:
        return self.cpu

    def grant(self, grant: p.Grant) -> bool:
        self.sent.append((self.task_id, grant))
        return True

    def revoke(self, grant_id: int) -> None:
        self.sent.append((self.task_id, p.Revoke(grant_id=grant_id)))

    def stop(self, reason: str) -> None:
        self.sent.append((self.task_id, p.Stop(reason=reason)))

    def hold(self, frozen: bool) -> None:
        self.frozen = frozen


class Harness:
    def __init__(self, margin_ns: int = 0) -> None:
        self.clock = ManualClock()
        self.latency = LatencyRecorder()
        self.sent: list[tuple[int, p.ManagerToWorker]] = []
        self.sched = DeviceScheduler("cpu:0", latency=self.latency, margin_ns=margin_ns, clock=self.clock)

    def grants(self) -> list[tuple[int, p.Grant]]:
        return [(t, m) for t, m in self.sent if isinstance(m, p.Grant)]

    def task(self, task_id: int, estimate_ns: int, *, kind: p.TaskKind = "iterative", fill: bool = False) -> TaskRecord:
        t = TaskRecord(
            task_id=task_id,
            spec=p.IterativeSpec(target="m:C", fill=fill) if kind == "iterative" else p.ProgramSpec(argv=["prog"]),
            name=f"t{task_id}",
            checkpoint_path=Path("/x"),
        )
        t.place("cpu:0")
        t.runner = RecordingRunner(task_id, self.sent)
        t.ready(estimate_ns=estimate_ns)
        self.sched.on_task_changed(t)
        return t

    def report(self, t: TaskRecord, d: p.GrantDone) -> None:
        """What the supervisor does with a grant's report."""
        t.account(d)
        self.sched.on_grant_done(t, d)

    def started(self, expected_ns: int, *, step: int = 0, index: int = 0) -> p.BubbleStarted:
        ev = p.BubbleStarted(
            rank=0,
            stage=0,
            device="cpu:0",
            step=step,
            index=index,
            t_ns=self.clock.now_ns(),
            expected_ns=expected_ns,
            spare_memory=-1,
        )
        self.sched.on_bubble_started(ev)
        return ev

    def ended(self, start: p.BubbleStarted, duration_ns: int) -> None:
        self.clock.set(max(self.clock.now_ns(), start.t_ns + duration_ns))
        self.sched.on_bubble_ended(
            p.BubbleEnded(
                rank=0,
                stage=0,
                device="cpu:0",
                step=start.step,
                index=start.index,
                t_ns=start.t_ns + duration_ns,
                duration_ns=duration_ns,
            )
        )


def done(
    t: TaskRecord,
    grant: p.Grant,
    *,
    reason: p.GrantDoneReason = "no_fit",
    busy: int = 0,
    delay: int = 100,
    end: int = 0,
    cpu: int = -1,
) -> p.GrantDone:
    return p.GrantDone(
        task_id=t.task_id,
        grant_id=grant.grant_id,
        steps=1 if busy else 0,
        busy_ns=busy,
        first_step_delay_ns=delay if busy else -1,
        overrun_ns=0,
        reason=reason,
        step_estimate_ns=t.estimate_ns,
        last_step_end_ns=end,
        cpu_ns=cpu,
    )


def test_a_bubble_is_granted_up_to_its_expected_end() -> None:
    h = Harness()
    h.task(1, 2 * MS)
    b = h.started(50 * MS)
    [(tid, grant)] = h.grants()
    assert tid == 1 and grant.bubble_t_ns == b.t_ns and grant.deadline_ns == b.t_ns + 50 * MS


def test_a_step_that_cannot_fit_gets_no_grant() -> None:
    h = Harness(margin_ns=1 * MS)
    h.task(1, 10 * MS)
    h.started(10 * MS)  # 10 ms step + 1 ms margin > 10 ms bubble
    assert h.grants() == []


def test_a_step_that_fits_exactly_is_granted() -> None:
    h = Harness(margin_ns=1 * MS)
    h.task(1, 9 * MS)
    h.started(10 * MS)  # 9 ms step + 1 ms margin == 10 ms bubble
    assert len(h.grants()) == 1


def test_time_already_gone_counts_against_the_fit() -> None:
    h = Harness()
    a, b = h.task(1, 5 * MS), h.task(2, 5 * MS)
    h.started(10 * MS)
    [(_, grant)] = h.grants()
    h.clock.advance(6 * MS)  # a's step took 6 ms: 4 ms are left, b's 5 ms step no longer fits
    h.report(a, done(a, grant, busy=6 * MS))
    assert len(h.grants()) == 1 and b.task_id == 2


def test_the_rest_of_a_bubble_passes_to_a_task_that_fits() -> None:
    h = Harness()
    big, _small = h.task(1, 20 * MS), h.task(2, 1 * MS)
    h.started(50 * MS)
    [(first, grant)] = h.grants()
    assert first == 1
    h.report(big, done(big, grant, busy=20 * MS))
    assert [t for t, _ in h.grants()] == [1, 2]


def test_a_task_is_not_granted_twice_in_one_bubble() -> None:
    h = Harness()
    t = h.task(1, 1 * MS)
    h.started(50 * MS)
    [(_, grant)] = h.grants()
    h.report(t, done(t, grant, busy=40 * MS))
    assert len(h.grants()) == 1


def test_tasks_take_turns_across_bubbles() -> None:
    h = Harness()
    a, b = h.task(1, 1 * MS), h.task(2, 1 * MS)
    for i in range(4):
        bubble = h.started(50 * MS, index=i)
        tid, grant = h.grants()[-1]
        holder = a if tid == 1 else b
        h.report(holder, done(holder, grant, reason="revoked", busy=1 * MS))
        h.ended(bubble, 50 * MS)
    assert [t for t, _ in h.grants()] == [1, 2, 1, 2]


def test_bubble_end_revokes_the_grant() -> None:
    h = Harness()
    h.task(1, 1 * MS)
    b = h.started(50 * MS)
    [(_, grant)] = h.grants()
    h.ended(b, 30 * MS)
    assert h.sent[-1] == (1, p.Revoke(grant_id=grant.grant_id))
    assert h.sched.bubbles == 1 and h.sched.bubble_ns == 30 * MS


def test_use_latency_and_overruns_are_accounted() -> None:
    h = Harness()
    t = h.task(1, 1 * MS)
    b = h.started(10 * MS)
    [(_, grant)] = h.grants()
    h.ended(b, 8 * MS)  # the bubble ended earlier than expected
    h.report(t, done(t, grant, reason="revoked", busy=9 * MS, delay=150_000, end=b.t_ns + 9 * MS))
    # the task was busy 9 ms, but only the 8 ms inside the bubble count as bubble time used
    assert h.sched.used_ns == 8 * MS and t.busy_ns == 9 * MS and t.steps == 1
    assert h.sched.overruns == 1 and h.sched.overrun_ns == 1 * MS
    assert h.latency.count == 1 and h.latency.summary()[0] == 150_000


def test_a_step_ending_inside_the_bubble_is_no_overrun() -> None:
    h = Harness()
    t = h.task(1, 1 * MS)
    b = h.started(10 * MS)
    [(_, grant)] = h.grants()
    h.report(t, done(t, grant, busy=5 * MS, end=b.t_ns + 5 * MS))
    h.ended(b, 10 * MS)
    assert h.sched.overruns == 0


def test_unknown_step_time_probes_only_at_a_bubble_start() -> None:
    h = Harness()
    known = h.task(1, 1 * MS)
    h.task(2, -1)
    h.started(50 * MS)
    [(tid, grant)] = h.grants()
    assert tid == 1
    h.report(known, done(known, grant, busy=1 * MS))  # rest of the bubble: not for the probe
    assert len(h.grants()) == 1
    h.started(50 * MS, index=1)
    assert h.grants()[-1][0] == 2


def test_a_task_that_becomes_runnable_mid_bubble_gets_it() -> None:
    h = Harness()
    h.started(50 * MS)
    assert h.grants() == []
    h.task(1, 1 * MS)
    assert [t for t, _ in h.grants()] == [1]


def test_a_lost_backend_revokes_and_stops_granting() -> None:
    h = Harness()
    h.task(1, 1 * MS)
    h.started(50 * MS)
    h.sched.backend_lost()
    assert isinstance(h.sent[-1][1], p.Revoke)
    h.task(2, 1 * MS)  # no bubble in progress any more
    assert len(h.grants()) == 1


def test_a_task_that_leaves_while_holding_passes_the_bubble_on() -> None:
    h = Harness()
    a, _b = h.task(1, 1 * MS), h.task(2, 1 * MS)
    h.started(50 * MS)
    assert [t for t, _ in h.grants()] == [1]
    a.request_stop()
    a.exited(0)  # cancelled
    h.sched.on_task_changed(a)
    assert [t for t, _ in h.grants()] == [1, 2] and a not in h.sched.tasks


def test_a_task_shut_out_by_its_estimate_gets_a_probe_now_and_then() -> None:
    h = Harness()
    t = h.task(1, 80 * MS)  # a stale estimate, larger than any bubble
    for i in range(PROBE_AFTER_BUBBLES - 1):
        b = h.started(20 * MS, index=i)
        h.ended(b, 20 * MS)
    assert h.grants() == []
    h.started(20 * MS, index=99)
    [(_, grant)] = h.grants()
    assert grant.probe
    t.estimate_ns = 1 * MS  # what the probe step measured
    h.report(t, done(t, grant, busy=1 * MS))
    h.started(20 * MS, index=100)
    assert not h.grants()[-1][1].probe


def test_a_probe_waits_for_one_of_the_longer_bubbles() -> None:
    """A step that may be long goes where it can best end in time: not to a 4 ms bubble between 40 ms ones."""
    h = Harness()
    h.task(1, 80 * MS)  # a stale estimate, larger than any bubble
    h.task(2, -1)  # a step time not measured yet
    granted: list[tuple[int, int, bool]] = []
    for i in range(3 * PROBE_AFTER_BUBBLES):
        length = 40 * MS if i % 5 == 0 else 4 * MS
        before = len(h.grants())
        b = h.started(length, index=i)
        granted += [(tid, length, g.probe) for tid, g in h.grants()[before:]]
        h.ended(b, length)
    assert granted  # both got their start ...
    assert {tid for tid, _, _ in granted} == {1, 2}
    assert all(length == 40 * MS for _, length, _ in granted)  # ... in the long bubbles only
    assert all(probe for tid, _, probe in granted if tid == 1)


class FakeProgram:
    """Stands in for an ImperativeProcess (no process): counts busy time by the manual clock."""

    pid = 0  # no process group to read: the runner's CPU clock reads -1
    exited = False

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.busy_ns = 0
        self.resumed_at: int | None = None
        self.deadlines: list[int] = []
        self.margins: list[int | None] = []

    def resume(self, deadline_ns: int, *, margin_ns: int | None = None) -> None:
        self.deadlines.append(deadline_ns)
        self.margins.append(margin_ns)
        self.resumed_at = self.clock.now_ns()

    def suspend(self) -> None:
        if self.resumed_at is not None:
            self.busy_ns += self.clock.now_ns() - self.resumed_at
            self.resumed_at = None


def test_a_program_is_granted_and_revoked_through_the_same_interface() -> None:
    """An imperative task's runner freezes the program at the bubble's end and reports like a worker."""
    h = Harness()
    t = TaskRecord(task_id=5, spec=p.ProgramSpec(argv=["prog"]), name="p", checkpoint_path=Path("/x"))
    t.place("cpu:0")
    program = FakeProgram(h.clock)
    t.runner = ProgramRunner(5, program, report=lambda d: h.report(t, d), clock=h.clock)
    t.ready()
    h.sched.on_task_changed(t)
    b = h.started(10 * MS)
    assert program.deadlines == [b.t_ns + 10 * MS]
    h.ended(b, 8 * MS)
    assert program.resumed_at is None  # frozen
    assert h.sched.used_ns == 8 * MS and t.busy_ns == 8 * MS and t.steps == 1
    assert h.sched.overruns == 0 and h.latency.count == 1 and h.latency.summary()[0] == 0


def test_bubbles_with_no_side_work_here_are_counted_and_not_judged() -> None:
    """As for a device the manager does not follow: the ledger counts them, the guard sees none."""
    h = Harness()
    for step in range(3):
        h.ended(h.started(20 * MS, step=step), 20 * MS)
        h.clock.advance(80 * MS)
    assert (h.sched.bubbles, h.sched.ledger.bubble_ns) == (3, 60 * MS)
    assert h.sched.guard.reason.startswith("learning: 0 of")
    start = h.started(20 * MS, step=3)
    h.clock.advance(5 * MS)
    t = h.task(1, 1 * MS)  # the first task, placed mid-bubble: the rest of it is granted
    ((_, grant),) = h.grants()
    assert grant.deadline_ns == start.t_ns + 20 * MS
    h.report(t, done(t, grant, busy=1 * MS, end=start.t_ns + 7 * MS))
    h.ended(start, 20 * MS)
    assert h.sched.guard.reason.startswith("learning: 1 of")
