"""The gate keeps the margin its grant carries (the device's interference guard sets it), on virtual time."""

from __future__ import annotations

import asyncio
from pathlib import Path

from test_gate import MARGIN, STEP, cancel, make_rig

from freeride import protocol as p


def grant(rig_now: int, grant_id: int, room_ns: int, margin_ns: int) -> p.Grant:
    return p.Grant(grant_id=grant_id, bubble_t_ns=rig_now, deadline_ns=rig_now + room_ns, margin_ns=margin_ns)


async def test_a_wider_margin_in_the_grant_keeps_a_step_out_that_the_assigned_one_lets_in(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.link.push(grant(rig.clock.now_ns(), 1, STEP + MARGIN, margin_ns=MARGIN + 1))
    stepping = asyncio.create_task(rig.step())
    await rig.link.parked()
    assert rig.link.done_brief() == [(1, "no_fit", 0)]

    rig.link.push(grant(rig.clock.now_ns(), 2, STEP + MARGIN + 1, margin_ns=MARGIN + 1))
    await stepping
    rig.gate.finish("finished")
    assert rig.link.done_brief() == [(1, "no_fit", 0), (2, "finished", 1)]


async def test_a_narrower_margin_in_the_grant_lets_in_a_step_the_assigned_one_keeps_out(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.link.push(grant(rig.clock.now_ns(), 1, STEP + MARGIN // 2, margin_ns=MARGIN // 2))
    await rig.step()
    rig.gate.finish("finished")
    assert rig.link.done_brief() == [(1, "finished", 1)]


async def test_a_grant_without_a_margin_keeps_the_assigned_one(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.link.push(grant(rig.clock.now_ns(), 1, STEP + MARGIN - 1, margin_ns=-1))
    stepping = asyncio.create_task(rig.step())
    await rig.link.parked()
    assert rig.link.done_brief() == [(1, "no_fit", 0)]
    await cancel(stepping)
