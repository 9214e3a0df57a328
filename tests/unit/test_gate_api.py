"""The side-task API on the worker's gate: pause/resume hooks, consistent checkpoints, the time left,
reported metrics and per-kind estimates, and waiting for a task's own input (virtual time, fake link)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_gate import MARGIN, STEP, FakeLink, FakeRunDelay, Saver

from freeride import protocol as p
from freeride.clock import ManualClock
from freeride.sidetask import IterativeTask, StepGate, TaskStopped, UnboundedGate
from freeride.worker.gate import GrantGate

MS = 1_000_000


class Recorder(IterativeTask):
    """Records the hooks the gate calls; its state is consistent only when ``consistent`` says so."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.consistent = True

    def step(self) -> None:
        self.events.append("step")

    def can_checkpoint(self) -> bool:
        return self.consistent

    def on_resume(self) -> None:
        self.events.append("resume")

    def on_pause(self) -> None:
        self.events.append("pause")

    def metrics(self) -> dict[str, float]:
        return {"own": 1.0}


class Rig:
    def __init__(self, tmp_path: Path, *, checkpoint_every_ns: int = 10**15, save_ns: int = 0) -> None:
        self.clock = ManualClock()
        self.link = FakeLink()
        self.saver = Saver(self.clock, save_ns)
        self.task = Recorder()
        assign = p.Assign(
            task_id=7,
            spec=p.IterativeSpec(target="tests:Recorder", step_time_ns=STEP),
            device="cpu",
            checkpoint_path=str(tmp_path / "task7.pt"),
            margin_ns=MARGIN,
            checkpoint_every_ns=checkpoint_every_ns,
        )
        self.gate = GrantGate(
            self.link,
            assign,
            self.task,
            0,
            save=self.saver,
            clock=self.clock,
            cpu_clock=self.clock.now_ns,
            run_delay=FakeRunDelay(self.clock),
        )

    def grant(self, grant_id: int, room_ns: int) -> p.Grant:
        now = self.clock.now_ns()
        return p.Grant(grant_id=grant_id, bubble_t_ns=now, deadline_ns=now + room_ns)

    async def step(self, took_ns: int = STEP, kind: str = "") -> None:
        async with asyncio.timeout(5), self.gate.step(kind):
            self.task.step()
            self.clock.advance(took_ns)

    def progress(self) -> list[p.Progress]:
        return [m for m in self.link.sent if isinstance(m, p.Progress)]


async def answered(link: FakeLink, grants: int) -> None:
    """Let the gate run until it has given ``grants`` grants back (the timeout only guards against a hang)."""
    async with asyncio.timeout(5):
        while len(link.done()) < grants:
            await asyncio.sleep(0)


def test_the_unbounded_and_the_grant_gate_both_implement_the_step_gate(tmp_path: Path) -> None:
    assert isinstance(UnboundedGate(), StepGate)
    assert isinstance(Rig(tmp_path).gate, StepGate)
    for name in ("remaining", "report", "wait_for", "idle_until"):
        assert callable(getattr(UnboundedGate(), name)) and callable(getattr(Rig(tmp_path).gate, name))


async def test_resume_and_pause_bracket_the_steps_of_each_grant(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.link.push(rig.grant(1, 2 * STEP + MARGIN))
    await rig.step()
    await rig.step()
    stepping = asyncio.create_task(rig.step())
    await rig.link.parked()  # the third step does not fit: the grant goes back
    assert rig.task.events == ["resume", "step", "step", "pause"]
    rig.link.push(rig.grant(2, STEP + MARGIN))
    await stepping
    rig.gate.finish("finished")
    assert rig.task.events == ["resume", "step", "step", "pause", "resume", "step", "pause"]


async def test_remaining_is_the_grant_left_minus_the_margin_and_none_outside_a_grant(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    assert rig.gate.remaining() is None
    rig.link.push(rig.grant(1, 5 * STEP))
    async with asyncio.timeout(5), rig.gate.step():
        rig.clock.advance(STEP)
        assert rig.gate.remaining() == pytest.approx((4 * STEP - MARGIN) / 1e9)
    rig.gate.finish("finished")
    assert rig.gate.remaining() is None


async def test_a_periodic_checkpoint_waits_for_a_consistent_state(tmp_path: Path) -> None:
    rig = Rig(tmp_path, checkpoint_every_ns=10 * MS)
    rig.gate.checkpoint()  # as the worker does before any bubble
    rig.task.consistent = False
    rig.clock.advance(20 * MS)  # due
    rig.link.push(rig.grant(1, 100 * STEP))
    await rig.step()
    await rig.step()
    assert rig.saver.saved_at_steps == [0]  # due and fitting, but the task said no
    rig.task.consistent = True
    await rig.step()
    assert rig.saver.saved_at_steps == [0, 2]


async def test_a_stop_between_consistent_points_runs_on_to_the_next_inside_the_grant(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.link.push(rig.grant(1, 100 * STEP))
    await rig.step()
    rig.task.consistent = False
    rig.link.push(p.Stop(reason="cancelled"))
    await rig.step()  # not consistent: one more step, the grant has room
    rig.task.consistent = True
    with pytest.raises(TaskStopped):
        await rig.step()
    assert rig.gate.steps == 2
    assert rig.gate.checkpoint_at_stop()
    assert rig.saver.saved_at_steps == [2]


async def test_a_stop_that_finds_no_consistent_point_keeps_the_last_checkpoint_and_says_so(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.gate.checkpoint()
    rig.link.push(rig.grant(1, STEP + MARGIN))
    await rig.step()
    rig.task.consistent = False
    rig.link.push(p.Stop(reason="cancelled"))
    with pytest.raises(TaskStopped):  # no room left in the grant to reach one
        await rig.step()
    assert not rig.gate.checkpoint_at_stop()
    assert rig.saver.saved_at_steps == [0]
    failed = [m for m in rig.link.sent if isinstance(m, p.CheckpointFailed)]
    assert len(failed) == 1 and "kept the checkpoint of step 0" in failed[0].error


async def test_reported_metrics_and_per_kind_estimates_reach_the_progress_reports(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.link.push(rig.grant(1, 100 * STEP))
    await rig.step(took_ns=2 * MS, kind="micro")
    rig.link.push(rig.grant(2, 100 * STEP))  # a kind not measured yet runs at the start of a grant
    await rig.step(took_ns=7 * MS, kind="update")
    rig.gate.report(loss=0.5)
    (progress,) = rig.progress()
    assert progress.metrics == {"own": 1.0, "loss": 0.5}
    assert progress.estimates == {"": STEP, "micro": 2 * MS, "update": 7 * MS}


async def test_the_estimates_reported_are_bounded(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    for i in range(p.MAX_ESTIMATE_KINDS + 10):
        rig.link.push(rig.grant(i + 1, 100 * STEP))
        await rig.step(took_ns=MS, kind=f"k{i}")
    progress = rig.gate.progress()
    assert len(progress.estimates) == p.MAX_ESTIMATE_KINDS
    assert f"k{p.MAX_ESTIMATE_KINDS + 9}" in progress.estimates  # the newest kinds


async def test_waiting_for_input_gives_every_grant_back_as_idle(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.link.push(rig.grant(1, 100 * STEP))
    await rig.step()
    inbox: asyncio.Queue[str] = asyncio.Queue()
    waiting = asyncio.create_task(rig.gate.wait_for(inbox.get()))
    await rig.link.parked()
    assert rig.link.done_brief() == [(1, "idle", 1)]  # the grant held went back at once
    assert rig.task.events == ["resume", "step", "pause"]
    assert rig.progress()[-1].waiting
    rig.link.push(rig.grant(2, 100 * STEP))  # a grant that comes while it waits goes back too
    await answered(rig.link, 2)
    assert rig.link.done_brief() == [(1, "idle", 1), (2, "idle", 0)]
    inbox.put_nowait("item")
    assert await waiting == "item"
    assert not rig.gate.progress().waiting


async def test_a_stop_while_waiting_for_input_stops_the_task_and_cancels_its_wait(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    unwound = asyncio.Event()

    async def own_io() -> str:
        try:
            await asyncio.Event().wait()  # input that never comes
        finally:
            unwound.set()
        return "never"

    waiting = asyncio.create_task(rig.gate.wait_for(own_io()))
    await rig.link.parked()
    rig.link.push(p.Stop(reason="cancelled"))
    with pytest.raises(TaskStopped, match="cancelled"):
        await waiting
    assert unwound.is_set()


async def test_idle_until_yields_each_item_and_ends_with_its_source(tmp_path: Path) -> None:
    rig = Rig(tmp_path)

    async def source() -> AsyncIterator[int]:
        for i in range(3):
            await asyncio.sleep(0)
            yield i

    async with asyncio.timeout(5):
        assert [i async for i in rig.gate.idle_until(source())] == [0, 1, 2]
        assert [i async for i in UnboundedGate().idle_until(source())] == [0, 1, 2]


async def test_the_unbounded_gate_waits_directly_and_keeps_reported_metrics() -> None:
    gate = UnboundedGate()
    assert gate.remaining() is None
    assert await gate.wait_for(asyncio.sleep(0, result=5)) == 5
    gate.report(loss=1.5)
    assert gate.reported == {"loss": 1.5}


async def test_a_task_that_waits_for_every_item_does_not_send_a_report_per_item(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    inbox: asyncio.Queue[int] = asyncio.Queue()
    for _ in range(50):  # virtual time stands still: all inside one report period
        waiting = asyncio.create_task(rig.gate.wait_for(inbox.get()))
        await rig.link.parked()
        inbox.put_nowait(1)
        await waiting
    assert len(rig.progress()) == 1 and rig.progress()[0].waiting


async def test_input_already_there_is_taken_with_the_grant_kept(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.link.push(rig.grant(1, 100 * STEP))
    await rig.step()
    inbox: asyncio.Queue[int] = asyncio.Queue()
    for i in range(3):
        inbox.put_nowait(i)

    async def listed() -> AsyncIterator[int]:  # a directory listed without waiting
        yield 7

    assert [await rig.gate.wait_for(inbox.get()) for _ in range(3)] == [0, 1, 2]
    assert [i async for i in rig.gate.idle_until(listed())] == [7]
    await rig.step()  # in the same grant
    assert rig.link.done_brief() == [] and not rig.progress()
