"""The worker's GrantGate on virtual time: which steps start, and what each grant reports back.

A :class:`~freeride.clock.ManualClock` stands in for the monotonic clock and a
fake link for the manager's socket, so every decision is driven explicitly:
a step "takes" exactly as long as the test advances the clock inside it.
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
        spec=p.TaskSpec(kind="iterative", target="tests:Task", step_time_ns=hint_ns),
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


async def test_a_periodic_checkpoint_runs_only_when_its_last_duration_fits(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, checkpoint_every_ns=100 * MS, save_ns=20 * MS)
    rig.gate.checkpoint()  # as the worker does before any bubble: learns that a save takes 20 ms
    rig.clock.advance(200 * MS)  # a checkpoint is due
    rig.link.push(rig.grant(1, STEP + MARGIN))  # room for a step, not for the checkpoint
    await rig.step()
    assert rig.saver.saved_at_steps == [0]

    stepping = asyncio.create_task(rig.step())
    await rig.link.parked()
    rig.link.push(rig.grant(2, 20 * MS + STEP + MARGIN))  # room for both: the checkpoint first
    await stepping
    rig.gate.finish("finished")
    assert rig.saver.saved_at_steps == [0, 1]
    assert rig.link.done_brief() == [(1, "no_fit", 1), (2, "finished", 1)]
    assert [d.busy_ns for d in rig.link.done()] == [STEP, 20 * MS + STEP]  # the save is busy time too
    assert [m.steps for m in rig.link.sent if isinstance(m, p.Checkpointed)] == [0, 1]


class Growing(IterativeTask):
    """A task whose state grows tenfold at its first step, as an optimizer's buffers appear at its first update."""

    def __init__(self) -> None:
        self.state = {"weights": bytearray(1000)}

    def step(self) -> None:
        self.state["momentum"] = bytearray(9000)

    def state_dict(self) -> dict[str, object]:
        return dict(self.state)


async def test_a_checkpoint_is_fitted_on_its_last_time_scaled_by_how_the_state_grew(tmp_path: Path) -> None:
    task = Growing()
    rig = make_rig(tmp_path, checkpoint_every_ns=100 * MS, save_ns=2 * MS, task=task)
    # the default reads tensors' nbytes; bytearrays stand in for tensors here
    rig.gate._state_bytes = rig.saver.size = lambda t: sum(len(v) for v in t.state_dict().values())
    rig.gate.checkpoint()  # before any bubble: 2 ms for 1000 bytes
    rig.link.push(rig.grant(1, STEP + MARGIN))
    await run_task_step(rig, task, STEP)  # the state is ten times larger now: a save takes ~20 ms
    rig.clock.advance(200 * MS)  # a checkpoint is due
    assert rig.gate.checkpoint_estimate_ns() == 20 * MS
    rig.link.push(rig.grant(2, 2 * MS + STEP + MARGIN))  # room for the old 2 ms save and a step, not a 20 ms save
    await run_task_step(rig, task, STEP)
    assert rig.saver.saved_at_steps == [0]  # no save squeezed in on the stale time
    assert rig.link.done_brief() == [(1, "expired", 1)]


def test_state_bytes_counts_tensor_data_in_nested_state() -> None:
    import numpy as np
    import torch

    from freeride.worker.checkpoint import state_bytes

    state = {"model": {"w": torch.zeros(10, 10)}, "opt": [torch.zeros(5, dtype=torch.float64)], "step": 3}
    assert state_bytes(state) == 400 + 40
    assert state_bytes((np.zeros(4, dtype=np.int16), "text", None)) == 8


# Race: the worker runs at the lowest CPU priority, so it can be preempted between
# deciding that a step fits and starting it. A step that would start after its
# latest start time must wait for the next grant rather than start late.
async def test_a_step_preempted_after_its_fit_decision_waits_instead_of_starting_late(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    ran_in: list[int] = []
    rig.link.push(rig.grant(1, STEP + MARGIN))  # fits, with nothing to spare
    rig.delay.preempt_at_next_read(1)  # one nanosecond lost after the decision

    async def step() -> None:
        async with asyncio.timeout(5), rig.gate.step():
            ran_in.append(len(rig.link.done()))
            rig.clock.advance(STEP)

    stepping = asyncio.create_task(step())
    await rig.link.parked()
    assert ran_in == []
    assert rig.link.done_brief() == [(1, "no_fit", 0)]

    rig.link.push(rig.grant(2, STEP + MARGIN))
    await stepping
    rig.gate.finish("finished")
    assert ran_in == [1]  # ran once, after grant 1 was given back
    assert rig.link.done_brief() == [(1, "no_fit", 0), (2, "finished", 1)]


async def test_time_spent_waiting_for_a_cpu_is_not_learned_as_step_time(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.link.push(rig.grant(1, 100 * STEP))
    async with asyncio.timeout(5), rig.gate.step():
        rig.clock.advance(6 * MS)
        rig.delay.wait(4 * MS)  # preempted mid-step by the training stage
    rig.gate.finish("finished")
    assert rig.gate.estimate_ns == 6 * MS
    (done,) = rig.link.done()
    assert (done.reason, done.steps) == ("finished", 1)
    assert done.busy_ns == 10 * MS  # what the step really occupied is reported as used
    assert done.step_estimate_ns == 6 * MS


async def test_a_bad_frame_is_logged_and_ignored(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.link.push(BadFrame(reason="garbage", size=3), rig.grant(1, STEP + MARGIN))
    await rig.step()
    rig.gate.finish("finished")
    assert rig.link.done_brief() == [(1, "finished", 1)]


async def test_a_grant_reports_the_cpu_clock_at_its_last_step_end(tmp_path: Path) -> None:
    """The manager subtracts its own reading at the bubble's end: what ran after it is interference."""
    rig = make_rig(tmp_path)
    rig.link.push(rig.grant(1, 10 * STEP))
    await rig.step()
    await rig.step()
    end = rig.clock.now_ns()
    rig.clock.advance(STEP)  # time passes with no step: not in the report
    rig.gate.finish("finished")
    assert rig.link.done()[0].cpu_ns == end


async def test_a_grant_without_a_step_reports_no_cpu_clock(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.link.push(rig.grant(1, STEP // 2))  # nothing fits
    stepping = asyncio.create_task(rig.step())
    await rig.link.parked()
    assert rig.link.done_brief() == [(1, "no_fit", 0)] and rig.link.done()[0].cpu_ns == -1
    await cancel(stepping)


class Halving(IterativeTask):
    """A packing task: its pending work runs whole, or as a half or a quarter where the whole does not fit."""

    def __init__(self) -> None:
        self.piece = ""
        self.ran: list[str] = []
        self.rooms: list[int] = []

    def step_kind(self) -> str:
        return self.piece

    def fit_piece(self, room_ns: int, estimate_ns: Callable[[str], int]) -> str | None:
        self.rooms.append(room_ns)
        for kind in ("", "half", "quarter"):
            if 0 <= estimate_ns(kind) <= room_ns:
                self.piece = kind
                return kind
        return None

    def step(self) -> None:
        self.ran.append(self.piece)
        self.piece = ""


async def run_task_step(rig: Rig, task: IterativeTask, took_ns: int) -> None:
    """One step of ``task`` as its own run loop would take it; it "takes" ``took_ns``."""
    async with asyncio.timeout(5), rig.gate.step(task.step_kind()):
        task.step()
        rig.clock.advance(took_ns)


async def test_a_packing_task_fills_the_end_of_a_grant_with_the_largest_piece_that_fits(tmp_path: Path) -> None:
    task = Halving()
    rig = make_rig(tmp_path, task=task)
    rig.gate.estimates.observe("half", 5 * MS)
    rig.gate.estimates.observe("quarter", 2 * MS)
    rig.link.push(rig.grant(1, 8 * MS + MARGIN))  # the whole step (10 ms) does not fit; a half does
    await run_task_step(rig, task, 5 * MS)
    await run_task_step(rig, task, 2 * MS)  # 3 ms left: a quarter
    step = asyncio.create_task(run_task_step(rig, task, STEP))  # 1 ms left: nothing fits
    await rig.link.parked()
    assert task.ran == ["half", "quarter"]
    assert task.rooms[:2] == [8 * MS, 3 * MS]  # what was left before the margin, as the task was told
    assert rig.link.done_brief() == [(1, "no_fit", 2)]
    rig.link.push(rig.grant(2, STEP + MARGIN))  # a whole step fits the next grant
    await step
    assert task.ran == ["half", "quarter", ""]
    await cancel(asyncio.create_task(run_task_step(rig, task, STEP)))


async def test_a_piece_s_time_is_learned_under_the_kind_that_ran(tmp_path: Path) -> None:
    task = Halving()
    rig = make_rig(tmp_path, task=task)
    rig.gate.estimates.observe("half", 5 * MS)
    rig.link.push(rig.grant(1, 6 * MS + MARGIN))
    await run_task_step(rig, task, 4 * MS)
    assert task.ran == ["half"]
    assert rig.gate.estimates.estimate_ns("half") == 4 * MS  # the p90 of 5 ms and 4 ms (nearest rank)
    assert rig.gate.estimates.estimate_ns("") == STEP  # the kind asked for is untouched


async def test_a_task_that_chooses_no_piece_keeps_its_pending_step(tmp_path: Path) -> None:
    class Counting(Task):
        asked = 0

        def fit_piece(self, room_ns: int, estimate_ns: Callable[[str], int]) -> str | None:
            Counting.asked += 1
            return None

    rig = make_rig(tmp_path, task=Counting())
    rig.link.push(rig.grant(1, 8 * MS + MARGIN))
    step = asyncio.create_task(rig.step())
    await rig.link.parked()
    assert Counting.asked >= 1 and rig.link.done_brief() == [(1, "no_fit", 0)]  # None keeps the pending step
    await cancel(step)
