"""The worker's GrantGate on virtual time: which steps start, and what each grant reports back.

A :class:`~freeride.clock.ManualClock` stands in for the monotonic clock and a
fake link for the manager's socket, so every decision is driven explicitly:
a step "takes" exactly as long as the test advances the clock inside it.

The rig (fake link, CPU-wait counter, saver, ``make_rig``) is shared: other test
modules import it from here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from freeride import protocol as p
from freeride.clock import ManualClock
from freeride.sidetask import IterativeTask, TaskStopped
from freeride.transport import BadFrame
from freeride.worker.gate import GrantGate

MS = 1_000_000
MARGIN = 1 * MS
STEP = 10 * MS
"""The step-time hint, and what a step takes unless a test says otherwise."""


class FakeLink:
    """The gate's side of the manager socket: an inbox the test fills and a list of what was sent."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[p.ManagerToWorker | BadFrame] = asyncio.Queue()
        self.sent: list[p.WorkerToManager] = []
        self._parked = asyncio.Event()

    def push(self, *msgs: p.ManagerToWorker | BadFrame) -> None:
        for msg in msgs:
            self.inbox.put_nowait(msg)

    def recv_nowait(self) -> p.ManagerToWorker | BadFrame | None:
        try:
            return self.inbox.get_nowait()
        except asyncio.QueueEmpty:
            return None

    async def recv(self) -> p.ManagerToWorker | BadFrame:
        self._parked.set()
        try:
            return await self.inbox.get()
        finally:
            self._parked.clear()

    def send_nowait(self, msg: p.WorkerToManager) -> None:
        self.sent.append(msg)

    async def parked(self) -> None:
        """Return once the gate waits for the manager (the timeout only guards against a hang)."""
        async with asyncio.timeout(5):
            await self._parked.wait()

    def done(self) -> list[p.GrantDone]:
        return [m for m in self.sent if isinstance(m, p.GrantDone)]

    def done_brief(self) -> list[tuple[int, str, int]]:
        """(grant_id, reason, steps) of every grant given back, in order."""
        return [(d.grant_id, d.reason, d.steps) for d in self.done()]


class FakeRunDelay:
    """The thread's CPU-wait counter; waiting also moves the clock, as a real preemption does."""

    def __init__(self, clock: ManualClock) -> None:
        self._clock = clock
        self.total = 0
        self._next_read_waits = 0

    def wait(self, ns: int) -> None:
        self._clock.advance(ns)
        self.total += ns

    def preempt_at_next_read(self, ns: int) -> None:
        """The gate reads the counter just after deciding a step fits: be preempted right there."""
        self._next_read_waits = ns

    def ns(self) -> int:
        if self._next_read_waits:
            self.wait(self._next_read_waits)
            self._next_read_waits = 0
        return self.total

    def close(self) -> None:
        pass


class Task(IterativeTask):
    def step(self) -> None:
        pass


@dataclass
class Saver:
    """Stands in for the checkpoint writer; a save takes ``took_ns`` of virtual time."""

    clock: ManualClock
    took_ns: int = 0
    saved_at_steps: list[int] | None = None
    size: Callable[[IterativeTask], int] = lambda task: 0
    """The bytes of tensor data a save reports having written."""

    def __call__(self, task: IterativeTask, path: Path, steps: int) -> int:
        self.clock.advance(self.took_ns)
        if self.saved_at_steps is None:
            self.saved_at_steps = []
        self.saved_at_steps.append(steps)
        return self.size(task)


@dataclass
class Rig:
    gate: GrantGate
    link: FakeLink
    clock: ManualClock
    delay: FakeRunDelay
    saver: Saver

    def grant(self, grant_id: int, room_ns: int, *, probe: bool = False, since_ns: int = 0) -> p.Grant:
        """A grant whose deadline is ``room_ns`` from now, for a bubble that began ``since_ns`` ago."""
        now = self.clock.now_ns()
        return p.Grant(grant_id=grant_id, bubble_t_ns=now - since_ns, deadline_ns=now + room_ns, probe=probe)

    async def step(self, took_ns: int = STEP, kind: str = "") -> None:
        """One step through the gate; a gate that parks for good fails the test instead of hanging it."""
        async with asyncio.timeout(5), self.gate.step(kind):
            self.clock.advance(took_ns)


async def cancel(task: asyncio.Task[None]) -> None:
    """Cancel a step still parked at the end of a test, and reap it."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def make_rig(
    tmp_path: Path,
    *,
    hint_ns: int = STEP,
    steps: int = 0,
    checkpoint_every_ns: int = 10**15,
    save_ns: int = 0,
    task: IterativeTask | None = None,
) -> Rig:
    clock = ManualClock()
    link = FakeLink()
    delay = FakeRunDelay(clock)
    saver = Saver(clock, save_ns)
    assign = p.Assign(
        task_id=7,
        spec=p.IterativeSpec(target="tests:Task", step_time_ns=hint_ns),
        device="cpu",
        checkpoint_path=str(tmp_path / "task7.pt"),
        margin_ns=MARGIN,
        checkpoint_every_ns=checkpoint_every_ns,
    )
    # the process's CPU clock runs with the wall clock here: nothing else takes the core
    gate = GrantGate(
        link, assign, task or Task(), steps, save=saver, clock=clock, cpu_clock=clock.now_ns, run_delay=delay
    )
    return Rig(gate, link, clock, delay, saver)


async def test_a_step_whose_estimate_ends_exactly_at_deadline_minus_margin_starts(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.link.push(rig.grant(1, STEP + MARGIN))
    await rig.step()  # starts without waiting for the manager
    rig.gate.finish("finished")
    assert rig.link.done_brief() == [(1, "finished", 1)]
    assert rig.link.done()[0].overrun_ns == 0


async def test_a_step_that_does_not_fit_gives_the_grant_back_and_takes_the_next(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.link.push(rig.grant(1, STEP + MARGIN - 1))  # one nanosecond short
    stepping = asyncio.create_task(rig.step())
    await rig.link.parked()
    assert rig.link.done_brief() == [(1, "no_fit", 0)]
    assert rig.link.done()[0].busy_ns == 0
    assert rig.link.done()[0].first_step_delay_ns == -1
    assert rig.link.done()[0].step_estimate_ns == STEP  # what the manager must fit next time

    rig.link.push(rig.grant(2, STEP + MARGIN))
    await stepping
    rig.gate.finish("finished")
    assert rig.link.done_brief() == [(1, "no_fit", 0), (2, "finished", 1)]


@pytest.mark.parametrize(
    ("probe", "hint_ns", "kinds"),
    [
        pytest.param(True, STEP, ("", "", ""), id="probe"),
        # every kind not measured yet is unknown
        pytest.param(False, -1, ("a", "b", "c"), id="unknown-estimate"),
    ],
)
async def test_a_probe_or_unknown_estimate_runs_exactly_one_step_at_the_start_of_an_open_grant(
    tmp_path: Path, probe: bool, hint_ns: int, kinds: tuple[str, str, str]
) -> None:
    rig = make_rig(tmp_path, hint_ns=hint_ns)
    # open by one nanosecond: the step runs even though it may take far longer
    grant = rig.grant(1, MARGIN + 1, probe=probe)
    rig.link.push(grant)
    await rig.step(kind=kinds[0])
    rig.link.push(rig.grant(2, 100 * STEP, probe=probe))
    await rig.step(kind=kinds[1])
    # plenty of room left, but a probe (or an unknown kind) gets one step per grant
    stepping = asyncio.create_task(rig.step(kind=kinds[2]))
    await rig.link.parked()
    assert rig.link.done_brief() == [(1, "expired", 1), (2, "no_fit", 1)]
    first = rig.link.done()[0]
    assert first.overrun_ns == STEP - MARGIN - 1  # it ran past the deadline, and says so
    assert first.last_step_end_ns == grant.deadline_ns + first.overrun_ns
    await cancel(stepping)


@pytest.mark.parametrize(
    ("probe", "hint_ns"), [pytest.param(True, STEP, id="probe"), pytest.param(False, -1, id="unknown-estimate")]
)
async def test_a_probe_or_unknown_estimate_does_not_start_once_the_grant_is_closed(
    tmp_path: Path, probe: bool, hint_ns: int
) -> None:
    rig = make_rig(tmp_path, hint_ns=hint_ns)
    rig.link.push(rig.grant(1, MARGIN, probe=probe))  # now is exactly deadline minus margin: closed
    stepping = asyncio.create_task(rig.step())
    await rig.link.parked()
    assert rig.link.done_brief() == [(1, "no_fit", 0)]
    await cancel(stepping)


async def test_a_step_far_past_its_bubbles_end_is_logged_with_its_kind_time_and_estimate(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rig = make_rig(tmp_path)
    caplog.set_level(logging.INFO, logger="freeride.worker.gate")
    rig.link.push(rig.grant(1, 100 * STEP))
    await rig.step(kind="fwd")  # well inside: not logged
    assert not [r for r in caplog.records if "past its bubble's end" in r.message]
    rig.link.push(rig.grant(2, STEP + MARGIN))
    await rig.step(took_ns=40 * STEP, kind="fwd")  # a 10 ms step that took 400 ms
    (record,) = [r for r in caplog.records if "past its bubble's end" in r.message]
    assert record.message.startswith("[worker] 'fwd' ran 389.0 ms past its bubble's end: it took 400.0 ms")
    assert "against an estimate of 10.0 ms, and started 11.0 ms before the deadline" in record.message


async def test_a_revoke_gives_the_grant_back_as_revoked(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.link.push(rig.grant(1, 100 * STEP))
    await rig.step()
    rig.link.push(p.Revoke(grant_id=99))  # a stale revoke for another grant changes nothing
    await rig.step()
    rig.link.push(p.Revoke(grant_id=1))
    stepping = asyncio.create_task(rig.step())
    await rig.link.parked()
    assert rig.link.done_brief() == [(1, "revoked", 2)]
    await cancel(stepping)


async def test_stop_raises_task_stopped_and_gives_the_grant_back_as_stopping(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.link.push(rig.grant(1, 100 * STEP))
    await rig.step()
    rig.link.push(p.Stop(reason="drain"))
    with pytest.raises(TaskStopped, match="drain"):
        await rig.step()
    assert rig.link.done_brief() == [(1, "stopping", 1)]


async def test_stop_while_parked_without_a_grant_gives_nothing_back(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    stepping = asyncio.create_task(rig.step())
    await rig.link.parked()
    rig.link.push(p.Stop(reason="drain"))
    with pytest.raises(TaskStopped):
        await stepping
    assert rig.link.done_brief() == []


async def test_a_second_grant_expires_the_one_held(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.link.push(rig.grant(1, 100 * STEP))
    await rig.step()
    rig.link.push(rig.grant(2, 100 * STEP))
    await rig.step()
    rig.gate.finish("finished")
    assert rig.link.done_brief() == [(1, "expired", 1), (2, "finished", 1)]


async def test_a_step_that_ends_past_the_deadline_reports_its_overrun(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    grant = rig.grant(1, STEP + MARGIN)
    rig.link.push(grant)
    await rig.step(took_ns=STEP + 4 * MS)  # slower than its estimate
    rig.gate.finish("finished")
    (done,) = rig.link.done()
    assert (done.reason, done.steps) == ("finished", 1)
    assert done.overrun_ns == 3 * MS
    assert done.last_step_end_ns == grant.deadline_ns + 3 * MS


async def test_first_step_delay_is_measured_from_the_bubble_start(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    grant = rig.grant(1, 100 * STEP, since_ns=3 * MS)  # the grant arrives 3 ms into the bubble
    rig.link.push(grant)
    await rig.step()
    await rig.step()  # only the first step of a grant counts
    rig.gate.finish("finished")
    (done,) = rig.link.done()
    assert done.first_step_delay_ns == 3 * MS
    assert done.first_step_ns == grant.bubble_t_ns + 3 * MS


async def test_busy_time_and_step_counts_are_per_grant(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, steps=100)  # restored from a checkpoint
    start = rig.clock.now_ns()
    rig.link.push(rig.grant(1, 5 * STEP))
    for _ in range(4):
        await rig.step()
        rig.clock.advance(MS)  # idle between steps: not busy time
    # 4 steps + 4 gaps = 44 ms used; 10 ms + margin no longer fits in the 6 ms left
    stepping = asyncio.create_task(rig.step())
    await rig.link.parked()
    rig.link.push(rig.grant(2, 100 * STEP))
    await stepping
    rig.gate.finish("finished")
    assert rig.link.done_brief() == [(1, "no_fit", 4), (2, "finished", 1)]
    first, second = rig.link.done()
    assert (first.busy_ns, first.total_steps) == (4 * STEP, 104)
    assert first.last_step_end_ns == start + 4 * STEP + 3 * MS
    assert (second.busy_ns, second.total_steps) == (STEP, 105)
    assert rig.gate.steps == 105


async def test_a_bad_frame_is_logged_and_ignored(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.link.push(BadFrame(reason="garbage", size=3), rig.grant(1, STEP + MARGIN))
    await rig.step()
    rig.gate.finish("finished")
    assert rig.link.done_brief() == [(1, "finished", 1)]
