"""Checkpoints of a state too large for a bubble (rig from test_gate): copied a slice per grant, then written.

Copying is given virtual time here, 0.5 ns a byte (a host copy runs at a few
GB/s): the gate must size each slice to the grant's room from what the last
ones took, run no step until the copy is whole, and let steps go on while a
thread writes it.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from test_gate import MARGIN, MS, STEP, FakeLink, FakeRunDelay, Rig, Saver

from freeride import protocol as p
from freeride.clock import ManualClock
from freeride.sidetask import IterativeTask
from freeride.worker import snapshot
from freeride.worker.checkpointing import STAGED_FROM_BYTES
from freeride.worker.gate import GrantGate

NS_PER_BYTE = 0.5


class Big(IterativeTask):
    """40 MB of weights; each step adds one to them, as an update would."""

    def __init__(self) -> None:
        self.w = torch.zeros(10_000_000)
        self.count = 0

    def step(self) -> None:
        self.w.add_(1.0)
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w, "count": self.count}


class Writes:
    """Stands in for the checkpoint file: keeps what each write got; a write can be held until released."""

    def __init__(self) -> None:
        self.states: list[tuple[int, Any]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def __call__(self, state: object, path: Path, steps: int) -> None:
        self.entered.set()
        assert self.release.wait(10)
        self.states.append((steps, state))


def timed_copies(monkeypatch: pytest.MonkeyPatch, clock: ManualClock) -> None:
    """Each byte a StateCopy copies takes NS_PER_BYTE of the rig's virtual time."""
    copy = snapshot.StateCopy.copy

    def timed(self: snapshot.StateCopy, max_bytes: int) -> int:
        n = copy(self, max_bytes)
        clock.advance(int(n * NS_PER_BYTE))
        return n

    monkeypatch.setattr(snapshot.StateCopy, "copy", timed)


def staged_rig(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, task: IterativeTask, writes: Writes, **assign: Any
) -> Rig:
    clock = ManualClock()
    timed_copies(monkeypatch, clock)
    link = FakeLink()
    delay = FakeRunDelay(clock)
    saver = Saver(clock)
    spec = p.IterativeSpec(target="tests:Big", step_time_ns=STEP)
    a = p.Assign(
        task_id=7,
        spec=spec,
        device="cpu",
        checkpoint_path=str(tmp_path / "task7.pt"),
        margin_ns=MARGIN,
        checkpoint_every_ns=assign.pop("checkpoint_every_ns", 100 * MS),
        **assign,
    )
    gate = GrantGate(link, a, task, 0, save=saver, write=writes, clock=clock, cpu_clock=clock.now_ns, run_delay=delay)
    return Rig(gate, link, clock, delay, saver)


async def given_back(rig: Rig, grant_id: int) -> None:
    """Return once the gate gave ``grant_id`` back."""
    async with asyncio.timeout(5):
        while grant_id not in [d.grant_id for d in rig.link.done()]:
            await asyncio.sleep(0)


async def task_step(rig: Rig, task: Big) -> None:
    async with asyncio.timeout(5), rig.gate.step():
        task.step()
        rig.clock.advance(STEP)


async def test_a_large_state_is_copied_a_slice_per_grant_and_written_while_the_steps_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task, writes = Big(), Writes()
    assert task.w.nbytes >= STAGED_FROM_BYTES
    rig = staged_rig(tmp_path, monkeypatch, task, writes)
    rig.gate.checkpoint_first()
    assert rig.saver.saved_at_steps is None and not writes.states  # nothing written before any bubble
    rig.link.push(rig.grant(1, STEP + MARGIN))
    await task_step(rig, task)
    rig.clock.advance(200 * MS)  # a checkpoint is due: 40 MB take 21 ms to copy, more than any grant's room

    writes.release.clear()
    stepping = asyncio.create_task(task_step(rig, task))
    room = 8 * MS
    for grant_id in range(2, 6):
        await rig.link.parked()
        rig.link.push(rig.grant(grant_id, room + MARGIN))
        await given_back(rig, grant_id)
    assert writes.entered.wait(5)  # the copy is whole and being written
    rig.link.push(rig.grant(6, STEP + MARGIN))
    await stepping  # steps go on while the write is held
    done = rig.link.done()
    copying = [d for d in done if d.grant_id in (2, 3, 4)]
    assert [d.steps for d in copying] == [0, 0, 0]  # no step while the copy was under way
    assert all(0 < d.busy_ns <= room and d.overrun_ns == 0 for d in copying), copying
    assert sum(d.busy_ns for d in copying) >= int(task.w.nbytes * NS_PER_BYTE)

    writes.release.set()
    rig.gate._checkpoints.settle()
    [(steps, state)] = writes.states
    assert steps == 1 and state["count"] == 1
    assert torch.all(state["w"] == 1.0) and torch.all(task.w == 2.0)  # the state as the copy began
    assert [m.steps for m in rig.link.sent if isinstance(m, p.Checkpointed)] == [1]
    assert rig.gate.unsaved_steps == 1


async def test_the_loss_bound_waits_for_the_staged_write_instead_of_forcing_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task, writes = Big(), Writes()
    rig = staged_rig(tmp_path, monkeypatch, task, writes, max_loss_steps=2)
    rig.gate.checkpoint_first()
    for grant_id in (1, 2):
        rig.link.push(rig.grant(grant_id, 30 * MS + MARGIN))
        await task_step(rig, task)
    writes.release.clear()
    stepping = asyncio.create_task(task_step(rig, task))
    await rig.link.parked()
    rig.link.push(rig.grant(3, 30 * MS + MARGIN))  # the bound: the state is copied (21 ms) before a third step
    await given_back(rig, 3)
    assert writes.entered.wait(5)
    await rig.link.parked()
    rig.link.push(rig.grant(4, 30 * MS + MARGIN))  # the write is held: a third step would leave 3 unsaved
    await given_back(rig, 4)
    assert rig.saver.saved_at_steps is None  # nothing forced at once beside the staged write
    writes.release.set()
    rig.gate._checkpoints.settle()
    rig.link.push(rig.grant(5, 30 * MS + MARGIN))
    await stepping
    assert [s for s, _ in writes.states] == [2]
    assert [(d.grant_id, d.steps) for d in rig.link.done()][2:] == [(3, 0), (4, 0)]


async def test_a_copy_that_cannot_have_its_memory_falls_back_to_saving_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_memory(self: snapshot.StateCopy, state: object) -> None:
        raise MemoryError("cannot allocate 40 MB")

    monkeypatch.setattr(snapshot.StateCopy, "__init__", no_memory)
    task, writes = Big(), Writes()
    rig = staged_rig(tmp_path, monkeypatch, task, writes, max_loss_steps=1)
    rig.gate.checkpoint_first()
    rig.link.push(rig.grant(1, STEP + MARGIN))
    await task_step(rig, task)
    rig.link.push(rig.grant(2, STEP + MARGIN))
    await task_step(rig, task)  # the bound: a copy failed, then the state was saved at the grant's start
    [failed] = [m for m in rig.link.sent if isinstance(m, p.CheckpointFailed)]
    assert "staged copy failed, saving at once from now on: MemoryError" in failed.error
    assert rig.saver.saved_at_steps == [1] and not writes.states


def test_a_periodic_staged_checkpoint_waits_for_steps_worth_nine_times_its_last_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    task, writes = Big(), Writes()
    rig = staged_rig(tmp_path, monkeypatch, task, writes)
    rig.gate.checkpoint_first()
    checkpoints = rig.gate._checkpoints

    def copying() -> bool:
        return checkpoints.due(rig.clock.now_ns(), 1, lambda: STEP).copying

    rig.clock.advance(200 * MS)  # a period passed: the first copy, its cost not known yet
    checkpoints.stepped(STEP)
    for _ in range(100):
        if not copying():
            break
        checkpoints.copy_slice(1, 4 << 20)
    checkpoints.settle()
    assert [s for s, _ in writes.states] == [1]
    copy_ns = int(task.w.nbytes * NS_PER_BYTE)  # the grant time the copy took: 20 ms

    rig.clock.advance(200 * MS)  # two periods later, with steps of 5 copies' time since
    checkpoints.stepped(5 * copy_ns)
    assert not copying()
    checkpoints.stepped(4 * copy_ns)  # 9 copies' time: worth the next one
    assert copying()
