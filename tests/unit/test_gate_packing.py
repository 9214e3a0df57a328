"""The worker's GrantGate fitting work other than a whole step into a grant (rig from test_gate):
checkpoints, timed on their last save scaled by the state's growth, and packing tasks' smaller pieces.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from test_gate import MARGIN, MS, STEP, Rig, Task, cancel, make_rig

from freeride import protocol as p
from freeride.sidetask import IterativeTask

# --- checkpoints ----------------------------------------------------------------------------------


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


async def test_a_periodic_checkpoint_that_fits_no_grant_for_three_periods_is_taken_at_a_grants_start(
    tmp_path: Path,
) -> None:
    rig = make_rig(tmp_path, checkpoint_every_ns=100 * MS, save_ns=500 * MS)
    rig.gate.checkpoint()  # one slow save (a process's first, a disk busy then): 500 ms, no bubble is that long
    rig.saver.took_ns = 2 * MS  # what a save takes now
    rig.clock.advance(250 * MS)  # due, but not yet for three periods: the step runs, the save waits
    rig.link.push(rig.grant(1, STEP + MARGIN))
    await rig.step()
    assert rig.saver.saved_at_steps == [0]

    rig.clock.advance(100 * MS)  # 350 ms since the last save: taken at the next grant's start
    rig.link.push(rig.grant(2, 2 * MS + STEP + MARGIN))  # room for a step and a 2 ms save, not a 500 ms one
    await rig.step()
    assert rig.saver.saved_at_steps == [0, 1]
    assert rig.gate.checkpoint_estimate_ns() == 2 * MS  # measured again: periodic ones fit from now on

    rig.clock.advance(150 * MS)
    rig.link.push(rig.grant(3, 2 * MS + STEP + MARGIN))
    await rig.step()
    assert rig.saver.saved_at_steps == [0, 1, 2]


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
    rig.gate._checkpoints.state_bytes = rig.saver.size = lambda t: sum(len(v) for v in t.state_dict().values())
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


# --- packing tasks: pieces that fit what is left --------------------------------------------------


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
