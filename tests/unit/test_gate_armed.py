"""The worker's GrantGate on the armed path: a step starts on the rank's own bubble start.

A :class:`~freeride.clock.ManualClock` stands in for the monotonic clock, a fake
link for the manager's socket and a fake feed for the rank's bubble publisher,
so which message comes first is chosen by each test.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from freeride import protocol as p
from freeride.clock import ManualClock
from freeride.sidetask import IterativeTask
from freeride.transport import BadFrame
from freeride.worker.armed import Arming
from freeride.worker.gate import GrantGate
from freeride.worker.gated import GatedSteps

MS = 1_000_000
MARGIN = 1 * MS
STEP = 10 * MS
ENDPOINT = "ipc:///run/fr/bubbles-0"


class Task(IterativeTask):
    def step(self) -> None:
        pass


class Wires:
    """The manager's link and the rank's feed as one fake: inboxes the test fills, and what was sent."""

    def __init__(self) -> None:
        self.inbox: list[p.ManagerToWorker | BadFrame] = []
        self.events: list[p.BubbleStarted | BadFrame] = []
        self.ends: list[p.BubbleEnded | BadFrame] = []
        self.sent: list[p.WorkerToManager] = []
        self.followed: list[str] = []
        self._kick = asyncio.Event()
        self._parked = asyncio.Event()

    # -- the test's side
    def push(self, *msgs: p.ManagerToWorker) -> None:
        self.inbox.extend(msgs)
        self._kick.set()

    def publish(self, event: p.BubbleStarted) -> None:
        self.events.append(event)
        self._kick.set()

    def publish_end(self, event: p.BubbleEnded) -> None:
        """A bubble end: read between steps, never woken for (as the real listener's)."""
        self.ends.append(event)

    async def parked(self) -> None:
        """Return once the gate waits for a message (the timeout only guards against a hang)."""
        async with asyncio.timeout(5):
            await self._parked.wait()

    def done(self) -> list[p.GrantDone]:
        return [m for m in self.sent if isinstance(m, p.GrantDone)]

    # -- GateLink
    def recv_nowait(self) -> p.ManagerToWorker | BadFrame | None:
        return self.inbox.pop(0) if self.inbox else None

    async def recv(self) -> p.ManagerToWorker | BadFrame:
        while not self.inbox:
            await self._wait()
        return self.inbox.pop(0)

    def send_nowait(self, msg: p.WorkerToManager) -> None:
        self.sent.append(msg)

    async def _wait(self) -> None:
        self._kick.clear()
        self._parked.set()
        try:
            await self._kick.wait()
        finally:
            self._parked.clear()


class Feed:
    """The gate's BubbleFeed over :class:`Wires`."""

    def __init__(self, wires: Wires) -> None:
        self.wires = wires

    def follow(self, endpoint: str) -> None:
        self.wires.followed.append(endpoint)

    def recv_nowait(self) -> p.BubbleStarted | BadFrame | None:
        return self.wires.events.pop(0) if self.wires.events else None

    def recv_end_nowait(self) -> p.BubbleEnded | BadFrame | None:
        return self.wires.ends.pop(0) if self.wires.ends else None

    async def wait(self) -> None:
        if not self.wires.inbox and not self.wires.events:
            await self.wires._wait()


class NoDelay:
    def ns(self) -> int:
        return 0

    def close(self) -> None:
        pass


class Courtesy:
    """Records what the gate asked of its :class:`~freeride.worker.courtesy.RankCourtesy`."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.followed: list[int] = []
        self.deferred_at: list[int] = []
        self.closed = False

    def follow(self, tid: int) -> None:
        self.followed.append(tid)

    def defer(self) -> int:
        self.deferred_at.append(self.clock.now_ns())
        return 0

    def close(self) -> None:
        self.closed = True


def make_gate(
    tmp_path: Path,
    clock: ManualClock,
    wires: Wires,
    *,
    feed: bool = True,
    courtesy: Courtesy | None = None,
    gated: GatedSteps | None = None,
) -> GrantGate:
    assign = p.Assign(
        task_id=7,
        spec=p.IterativeSpec(target="tests:Task", step_time_ns=STEP),
        device="cpu:0",
        checkpoint_path=str(tmp_path / "task7.pt"),
        margin_ns=MARGIN,
        checkpoint_every_ns=10**15,
    )
    return GrantGate(
        wires,
        assign,
        Task(),
        0,
        save=lambda task, path, steps: True,
        clock=clock,
        cpu_clock=lambda: clock.now_ns() + 5,  # the process's CPU clock, offset to tell it apart
        run_delay=NoDelay(),
        feed=Feed(wires) if feed else None,
        courtesy=courtesy,
        gated=gated,
    )


def started(clock: ManualClock, expected_ns: int, *, ago_ns: int = 0) -> p.BubbleStarted:
    return p.BubbleStarted(
        rank=0, stage=0, device="cpu:0", step=1, index=0, t_ns=clock.now_ns() - ago_ns, expected_ns=expected_ns
    )


async def run_one_step(gate: GrantGate, clock: ManualClock) -> None:
    async with asyncio.timeout(5), gate.step():
        clock.advance(STEP)


async def test_an_armed_worker_starts_on_the_ranks_event_without_a_grant(tmp_path: Path) -> None:
    clock, wires = ManualClock(), Wires()
    gate = make_gate(tmp_path, clock, wires)
    wires.push(p.Arm(grant_id=5, endpoint=ENDPOINT, after_ns=clock.now_ns() - 1))
    stepping = asyncio.create_task(run_one_step(gate, clock))
    await wires.parked()
    assert wires.followed == [ENDPOINT]
    assert not wires.done()  # armed, waiting for the bubble: nothing to give back yet

    clock.advance(3 * MS)
    bubble = started(clock, 2 * STEP)
    clock.advance(200_000)  # the event's way to the worker
    taken_at = clock.now_ns()
    wires.publish(bubble)
    await stepping
    gate.finish("finished")
    [done] = wires.done()
    assert (done.grant_id, done.reason, done.steps, done.armed) == (5, "finished", 1, True)
    assert done.first_step_delay_ns == 200_000  # from the rank's own timestamp, as for a Grant
    assert done.cpu_at_start_ns == taken_at + 5


async def test_a_bubble_seen_before_the_arm_is_taken_when_the_arm_comes(tmp_path: Path) -> None:
    clock, wires = ManualClock(), Wires()
    gate = make_gate(tmp_path, clock, wires)
    before = clock.now_ns()
    clock.advance(MS)
    wires.publish(started(clock, 2 * STEP))
    wires.push(p.Arm(grant_id=5, endpoint=ENDPOINT, after_ns=before))
    await run_one_step(gate, clock)
    gate.finish("finished")
    assert [(d.grant_id, d.armed) for d in wires.done()] == [(5, True)]


async def test_a_bubble_not_after_the_arm_starts_nothing_and_the_managers_grant_still_does(tmp_path: Path) -> None:
    clock, wires = ManualClock(), Wires()
    gate = make_gate(tmp_path, clock, wires)
    old = started(clock, 2 * STEP)  # the bubble the manager had already handed out
    wires.publish(old)
    wires.push(p.Arm(grant_id=5, endpoint=ENDPOINT, after_ns=old.t_ns))
    stepping = asyncio.create_task(run_one_step(gate, clock))
    await wires.parked()
    assert not wires.done()

    # the worker missed the next bubble's event: the manager's Grant starts it (two hops)
    clock.advance(MS)
    wires.push(p.Grant(grant_id=5, bubble_t_ns=clock.now_ns(), deadline_ns=clock.now_ns() + 2 * STEP))
    await stepping
    gate.finish("finished")
    [done] = wires.done()
    assert (done.grant_id, done.steps, done.armed) == (5, 1, False)
    assert done.cpu_at_start_ns == -1  # the manager read the CPU clock itself


async def test_the_managers_repeat_of_a_taken_armed_grant_is_ignored(tmp_path: Path) -> None:
    clock, wires = ManualClock(), Wires()
    gate = make_gate(tmp_path, clock, wires)
    wires.push(p.Arm(grant_id=5, endpoint=ENDPOINT, after_ns=0))
    bubble = started(clock, 3 * STEP)
    wires.publish(bubble)
    await run_one_step(gate, clock)
    wires.push(p.Grant(grant_id=5, bubble_t_ns=bubble.t_ns, deadline_ns=bubble.t_ns + bubble.expected_ns))
    await run_one_step(gate, clock)  # still the same grant: no "expired", no second first step
    wires.push(p.Revoke(grant_id=5))
    stepping = asyncio.create_task(run_one_step(gate, clock))
    await wires.parked()
    assert [(d.grant_id, d.reason, d.steps, d.armed) for d in wires.done()] == [(5, "revoked", 2, True)]
    stepping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stepping


async def test_an_armed_step_that_does_not_fit_gives_the_bubble_back_at_once(tmp_path: Path) -> None:
    clock, wires = ManualClock(), Wires()
    gate = make_gate(tmp_path, clock, wires)
    wires.push(p.Arm(grant_id=5, endpoint=ENDPOINT, after_ns=0))
    wires.publish(started(clock, STEP + MARGIN - 1))  # one nanosecond short
    stepping = asyncio.create_task(run_one_step(gate, clock))
    await wires.parked()
    [done] = wires.done()
    assert (done.grant_id, done.reason, done.steps, done.armed) == (5, "no_fit", 0, True)
    assert done.first_step_delay_ns == -1
    stepping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stepping


async def test_a_worker_stops_at_its_ranks_bubble_end_without_the_managers_revoke(tmp_path: Path) -> None:
    # The manager reads a rank's events in batches while no decision waits on them: its Revoke may come
    # late. The rank's own end, read between steps, ends the grant: no step starts past it.
    clock, wires = ManualClock(), Wires()
    gate = make_gate(tmp_path, clock, wires)
    wires.push(p.Arm(grant_id=5, endpoint=ENDPOINT, after_ns=0))
    bubble = started(clock, 10 * STEP)  # predicted long enough for ten steps
    wires.publish(bubble)
    await run_one_step(gate, clock)
    wires.publish_end(
        p.BubbleEnded(rank=0, stage=0, device="cpu:0", step=1, index=0, t_ns=clock.now_ns(), duration_ns=STEP)
    )
    stepping = asyncio.create_task(run_one_step(gate, clock))
    await wires.parked()
    assert gate.steps == 1  # the second step did not start
    assert [(d.grant_id, d.reason, d.steps) for d in wires.done()] == [(5, "revoked", 1)]
    stepping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stepping


def test_an_end_of_an_earlier_bubble_does_not_end_the_grant() -> None:
    arming = Arming()
    arming.ended(p.BubbleEnded(rank=0, stage=0, device="cpu:0", step=1, index=0, t_ns=100, duration_ns=50))
    assert arming.over(p.Grant(grant_id=1, bubble_t_ns=99, deadline_ns=200))
    assert not arming.over(p.Grant(grant_id=1, bubble_t_ns=100, deadline_ns=200))
    assert not arming.over(p.Grant(grant_id=1, bubble_t_ns=150, deadline_ns=300))


async def test_a_disarmed_worker_ignores_the_next_bubble(tmp_path: Path) -> None:
    clock, wires = ManualClock(), Wires()
    gate = make_gate(tmp_path, clock, wires)
    wires.push(p.Arm(grant_id=5, endpoint=ENDPOINT, after_ns=0), p.Disarm(grant_id=5))
    stepping = asyncio.create_task(run_one_step(gate, clock))
    await wires.parked()
    clock.advance(MS)
    wires.publish(started(clock, 3 * STEP))
    await asyncio.sleep(0)  # let the gate look (it must not start)
    await wires.parked()
    assert gate.steps == 0 and not wires.done()
    stepping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stepping


async def test_a_revoke_for_an_arm_whose_bubble_never_came_is_answered(tmp_path: Path) -> None:
    # without the answer the manager would hold the grant open until its hang detector fired
    clock, wires = ManualClock(), Wires()
    gate = make_gate(tmp_path, clock, wires)
    wires.push(p.Arm(grant_id=5, endpoint=ENDPOINT, after_ns=0))
    stepping = asyncio.create_task(run_one_step(gate, clock))
    await wires.parked()
    wires.push(p.Revoke(grant_id=5))
    await asyncio.sleep(0)
    await wires.parked()
    assert [(d.grant_id, d.reason, d.steps) for d in wires.done()] == [(5, "revoked", 0)]
    # and the arm is spent: a late event starts nothing
    wires.publish(started(clock, 3 * STEP))
    await asyncio.sleep(0)
    await wires.parked()
    assert gate.steps == 0
    stepping.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stepping


async def test_without_a_feed_an_arm_is_ignored(tmp_path: Path) -> None:
    clock, wires = ManualClock(), Wires()
    gate = make_gate(tmp_path, clock, wires, feed=False)  # a worker that cannot follow its rank
    wires.push(p.Arm(grant_id=5, endpoint=ENDPOINT, after_ns=0))
    wires.publish(started(clock, 3 * STEP))
    stepping = asyncio.create_task(run_one_step(gate, clock))
    await wires.parked()
    assert gate.steps == 0 and wires.followed == []
    wires.push(p.Grant(grant_id=6, bubble_t_ns=clock.now_ns(), deadline_ns=clock.now_ns() + 3 * STEP))
    await stepping
    assert gate.steps == 1


def test_an_armed_grant_takes_the_guards_margin_and_prediction_factor() -> None:
    from freeride.worker.armed import Arming

    arming = Arming()
    arming.armed(p.Arm(grant_id=5, endpoint="ipc:///x", after_ns=0, margin_ns=2_000_000, prediction_factor=0.5))
    arming.seen(p.BubbleStarted(rank=0, stage=0, device="cpu:0", step=1, index=0, t_ns=100, expected_ns=40_000_000))
    grant = arming.take()
    assert grant is not None
    # as the manager's Grant for the same bubble: t + round(expected * factor), the guard's margin
    assert (grant.grant_id, grant.deadline_ns, grant.margin_ns) == (5, 100 + 20_000_000, 2_000_000)


def test_an_armed_worker_lets_a_bubble_the_guard_leaves_out_pass_and_takes_the_next() -> None:
    from freeride.worker.armed import Arming

    arming = Arming()
    arming.armed(p.Arm(grant_id=5, endpoint="ipc:///x", after_ns=0, prediction_factor=0.5, min_bubble_ns=4_000_000))
    # 7 ms at x0.5: 3.5 ms, under the guard's 4 ms (the manager grants it to no one)
    arming.seen(p.BubbleStarted(rank=0, stage=0, device="cpu:0", step=1, index=0, t_ns=100, expected_ns=7_000_000))
    assert arming.take() is None
    assert arming.arm is not None  # still armed, for the next bubble
    arming.seen(p.BubbleStarted(rank=0, stage=0, device="cpu:0", step=1, index=1, t_ns=900, expected_ns=8_000_000))
    grant = arming.take()
    assert grant is not None and (grant.grant_id, grant.bubble_t_ns, grant.deadline_ns) == (5, 900, 900 + 4_000_000)


def test_an_armed_worker_lets_a_held_back_step_pass_and_takes_the_first_bubble_after_it() -> None:
    from freeride.holdback import HoldbackSchedule
    from freeride.worker.armed import Arming

    holdback = p.Holdback(job="j", block_steps=2, every=4, max_every=4)
    schedule = HoldbackSchedule(holdback)
    held = next(s for s in range(2, 100) if schedule.held(s))
    after = next(s for s in range(held, 100) if not schedule.held(s))
    arming = Arming()
    arming.armed(p.Arm(grant_id=5, endpoint="ipc:///x", after_ns=0, holdback=holdback))
    # the manager grants no bubble of a held-back step (it measures the job's cost there)
    for k, step in enumerate(range(held, after)):
        ev = p.BubbleStarted(rank=0, stage=0, device="cpu:0", step=step, index=0, t_ns=100 + k, expected_ns=9_000_000)
        arming.seen(ev)
        assert arming.take() is None and arming.arm is not None
    arming.seen(p.BubbleStarted(rank=0, stage=0, device="cpu:0", step=after, index=0, t_ns=900, expected_ns=9_000_000))
    grant = arming.take()
    assert grant is not None and grant.bubble_t_ns == 900


def test_an_armed_worker_lets_the_bubbles_its_jobs_budget_leaves_out_pass_and_takes_a_granted_one() -> None:
    from freeride.holdback import granted
    from freeride.worker.armed import Arming

    bubbles = [(step, index) for step in range(2, 60) for index in range(3)]
    left_out = [b for b in bubbles if not granted(0.5, *b)][:5]
    kept = next(b for b in bubbles if granted(0.5, *b) and b > left_out[-1])
    arming = Arming()
    arming.armed(p.Arm(grant_id=5, endpoint="ipc:///x", after_ns=0, harvest_share=0.5))
    # the manager grants none of the bubbles the budget leaves out: the arm waits for one it grants
    for k, (step, index) in enumerate(left_out):
        ev = p.BubbleStarted(rank=0, stage=0, device="cpu:0", step=step, index=index, t_ns=100 + k, expected_ns=9 * MS)
        arming.seen(ev)
        assert arming.take() is None and arming.arm is not None
    step, index = kept
    arming.seen(p.BubbleStarted(rank=0, stage=0, device="cpu:0", step=step, index=index, t_ns=900, expected_ns=9 * MS))
    grant = arming.take()
    assert grant is not None and (grant.grant_id, grant.bubble_t_ns) == (5, 900)


def test_an_arm_carries_a_share_of_bubbles_between_none_and_all() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(
            msgspec.msgpack.encode(p.Arm(grant_id=1, endpoint="ipc:///x", after_ns=0, harvest_share=1.5)),
            type=p.Arm,
        )


async def test_the_first_step_of_a_grant_lets_the_ranks_announcing_thread_block_first(tmp_path: Path) -> None:
    clock, wires = ManualClock(), Wires()
    courtesy = Courtesy(clock)
    gate = make_gate(tmp_path, clock, wires, courtesy=courtesy)
    wires.push(p.Arm(grant_id=5, endpoint=ENDPOINT, after_ns=clock.now_ns() - 1))
    clock.advance(MS)
    wires.publish(msgspec.structs.replace(started(clock, 4 * STEP), thread=4321))
    await run_one_step(gate, clock)
    await run_one_step(gate, clock)  # the same grant's second step: the rank has long blocked
    gate.finish("finished")
    assert courtesy.followed == [4321]
    assert len(courtesy.deferred_at) == 1
    assert courtesy.closed
    [done] = wires.done()
    assert (done.grant_id, done.steps) == (5, 2)
