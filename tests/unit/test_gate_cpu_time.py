"""The worker's GrantGate and CPU time (rig from test_gate): a step preempted after its fit decision,
time spent waiting for a core, and the CPU clock a grant reports.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from test_gate import MARGIN, MS, STEP, cancel, make_rig


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


async def test_a_grant_reports_the_cpu_clock_at_its_last_steps_start_and_end(tmp_path: Path) -> None:
    """The manager subtracts its own reading at the bubble's end: what ran after it is interference."""
    rig = make_rig(tmp_path)
    rig.link.push(rig.grant(1, 10 * STEP))
    await rig.step()
    rig.clock.advance(STEP)  # time passes between steps
    start = rig.clock.now_ns()
    await rig.step()
    end = rig.clock.now_ns()
    rig.clock.advance(STEP)  # time passes with no step: not in the report
    rig.gate.finish("finished")
    (done,) = rig.link.done()
    assert done.cpu_ns == end
    # and the last step's start with the clock then: the manager's account of an end it reads late
    assert (done.last_step_start_ns, done.cpu_at_last_step_ns) == (start, start)


async def test_a_grant_without_a_step_reports_no_cpu_clock(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    rig.link.push(rig.grant(1, STEP // 2))  # nothing fits
    stepping = asyncio.create_task(rig.step())
    await rig.link.parked()
    assert rig.link.done_brief() == [(1, "no_fit", 0)] and rig.link.done()[0].cpu_ns == -1
    await cancel(stepping)
