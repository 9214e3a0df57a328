"""The manager's side of the bubble gate: which slot a rank is told to open, and where the host opens one.

The scheduler is driven by hand as in ``test_scheduler_arming.py``; the gate
page is the real shared page the ranks and workers map (the manager itself
never touches CUDA, so nothing here is a stand-in but the runners).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_scheduler_arming import ENDPOINT, MS, Harness, _info, done

from freeride import protocol as p
from freeride.gpu.bubblegate import GateWord, page_path
from freeride.serve.costs import TrainingCosts
from freeride.serve.gates import DeviceGate, GatePages
from freeride.serve.scheduler import DeviceScheduler
from freeride.serve.tasks import TaskRecord


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[DeviceGate]:
    g = DeviceGate(GateWord.create(tmp_path / "gate-cuda-0"))
    yield g
    g.close()


def _gated(gate: DeviceGate, *, costs: TrainingCosts | None = None) -> Harness:
    h = Harness()
    h.sched = DeviceScheduler("cpu:0", latency=h.latency, margin_ns=0, clock=h.clock, costs=costs, gate=gate)
    h.sched.follow_rank(ENDPOINT)
    return h


def _ready(h: Harness, gate: DeviceGate, task_id: int, estimate_ns: int, *, said: str = "ready") -> TaskRecord:
    gate.ready[task_id] = said  # what its worker said in its WorkerReady, before the scheduler hears of it
    return h.task(task_id, estimate_ns)


def test_a_task_whose_worker_can_use_the_gate_is_armed_with_its_slot_and_the_rank_told_which(gate: DeviceGate) -> None:
    h = _gated(gate)
    _ready(h, gate, 7, 2 * MS)
    [(_, arm)] = h.arms()
    assert h.sched.guard.min_bubble_ns == 4 * MS
    assert arm.gate_slot == 1 and arm.gate_open_ns == 4 * MS  # the guard's shortest bubble: longer than the step
    assert gate.word.control() == (1, 4 * MS)  # what the rank reads at its next bubble
    assert not gate.word.state(1).open  # shut: the step the worker queues waits for the rank's opening


def test_a_bubble_shorter_than_the_queued_step_keeps_the_arm_and_goes_to_the_others(gate: DeviceGate) -> None:
    h = _gated(gate)
    h.sched.guard.min_bubble_ns = 0  # every bubble is worth side work: only the queued step's length counts
    t1 = _ready(h, gate, 1, 5 * MS)
    h.task(2, MS)  # on the host's path only
    [(_, arm)] = h.arms()
    assert arm.gate_slot == 1
    short = h.started(3 * MS)  # the rank leaves slot 1 shut here: task 1's step is still queued
    assert [t for t, _ in h.grants()] == [2] and h.of(p.Disarm) == []
    assert not gate.word.state(1).open and gate.word.control() == (1, 5 * MS)
    h.report(h.sched.tasks[1], done(h.sched.tasks[1], h.grants()[0][1].grant_id, busy=MS, armed=False))
    h.ended(short, 3 * MS)
    assert len(h.arms()) == 1  # the same arm waits for the next bubble
    h.started(10 * MS)  # long enough: the rank opens slot 1, and the arm is honoured
    assert [t for t, _ in h.grants()][-1] == 1  # the fallback Grant of a worker not yet heard
    assert not gate.word.state(1).open  # no host release: the rank's stream opens it, on the device
    h.report(t1, done(t1, arm.grant_id, reason="revoked", busy=4 * MS))


def test_a_step_the_ranks_stream_never_released_is_released_at_its_bubbles_end(gate: DeviceGate) -> None:
    """The rank opens the slot on a page the manager made; a rank that still maps the page of a manager before
    this one opens nothing the worker waits on. The grant not back at its bubble's end has its slot opened."""
    h = _gated(gate)
    t1 = _ready(h, gate, 1, 2 * MS)
    [(_, arm)] = h.arms()
    bubble = h.started(10 * MS)  # the arm is honoured: the manager counts the task as the bubble's holder
    assert not gate.word.state(1).open
    h.ended(bubble, 10 * MS)  # and no report came: its step is still queued, or still running
    state = gate.word.state(1)
    assert state.open and state.host
    [*_, (_, again)] = h.arms()  # armed again at once, but without its slot: that would shut its step in again
    assert again.grant_id != arm.grant_id and again.gate_slot == 0 and gate.word.control() == (0, 0)
    assert gate.word.state(1).open
    h.report(t1, done(t1, arm.grant_id, reason="revoked", busy=2 * MS))  # the step ran, late
    second = h.started(10 * MS)
    h.report(t1, done(t1, again.grant_id, reason="revoked", busy=2 * MS, end=second.t_ns + 2 * MS))
    h.ended(second, 10 * MS)
    [*_, (_, third)] = h.arms()
    assert third.gate_slot == 1 and not gate.word.state(1).open  # its grants are back: the slot is used again


def test_a_grant_on_the_hosts_path_releases_the_tasks_slot(gate: DeviceGate) -> None:
    h = _gated(gate)
    gate.ready[3] = "ready"
    t = h.task(3, 2 * MS)
    t.runner.armable = False  # type: ignore[union-attr]  # its socket refuses the arm: Grants serve it
    h.sched.follow_rank("")
    h.sched.follow_rank(ENDPOINT)
    assert gate.word.control() == (0, 0)
    h.started(10 * MS)
    assert [t for t, _ in h.grants()] == [3]
    state = gate.word.state(gate.slot(3))
    assert state.open and state.host  # what it queued behind its slot runs in this grant


def test_when_the_rank_is_gone_every_slot_opens_and_none_is_named(gate: DeviceGate) -> None:
    h = _gated(gate)
    _ready(h, gate, 1, 2 * MS)
    assert gate.word.control()[0] == 1
    h.sched.backend_lost()
    assert gate.word.control() == (0, 0)
    assert gate.word.state(1).open and gate.word.state(1).host  # nothing waits on a gate nobody opens


def test_a_worker_that_cannot_use_the_gate_is_armed_on_the_hosts_path(gate: DeviceGate) -> None:
    h = _gated(gate)
    _ready(h, gate, 1, 2 * MS, said="cuStreamWaitValue32 failed: CUDA_ERROR_NOT_SUPPORTED (801)")
    [(_, arm)] = h.arms()
    assert (arm.gate_slot, arm.gate_open_ns) == (0, 0) and gate.word.control() == (0, 0)
    assert gate.describe() == (
        "device gate, used by no task yet; task 1 on the host path: "
        "cuStreamWaitValue32 failed: CUDA_ERROR_NOT_SUPPORTED (801)"
    )


def test_while_the_budget_leaves_bubbles_out_no_slot_is_named(gate: DeviceGate) -> None:
    """The rank cannot tell which bubbles a smaller share leaves out: the gate is used only while it grants all."""
    costs = TrainingCosts(p.Holdback(block_steps=2, every=4, max_every=4), budget=0.005)
    costs.hello(0, "job-7")
    h = _gated(gate, costs=costs)
    t1 = _ready(h, gate, 1, 2 * MS)
    [(_, arm)] = h.arms()
    assert arm.gate_slot == 1
    for step in range(2, 2 + 12 * 8):  # pairs whose cost lies wholly above the budget: harvesting backs off
        costs.step_finished(0, step, 150_000_000 if costs.withheld(0, step, 0) != "held_back" else 100_000_000)
    assert costs.harvest_share(0) < 1.0
    ev = h.started(10 * MS, step=500)
    h.report(t1, done(t1, arm.grant_id, reason="revoked", busy=MS, end=ev.t_ns + 2 * MS))
    h.ended(ev, 10 * MS)
    [*_, (_, rearmed)] = h.arms()
    assert rearmed.grant_id != arm.grant_id and rearmed.harvest_share < 1.0
    assert (rearmed.gate_slot, gate.word.control()) == (0, (0, 0))


def test_a_task_that_leaves_frees_its_slot_and_releases_what_waits(gate: DeviceGate) -> None:
    h = _gated(gate)
    t = _ready(h, gate, 1, 2 * MS)
    t.fail("gone")
    h.sched.on_task_changed(t)
    assert gate.word.control() == (0, 0) and gate.word.state(1).open
    assert 1 not in gate.ready and gate.slot(2) == 1  # the slot is free for the next task
    assert h.sched.status(_info()).used_ns == 0


def test_the_manager_makes_a_page_per_cuda_device_only_and_removes_it(tmp_path: Path) -> None:
    pages = GatePages(tmp_path)
    assert pages.open("cpu:0") is None
    stale = page_path(tmp_path, "cuda:0")
    stale.write_bytes(b"left by a manager before")
    gate = pages.open("cuda:0")
    assert gate is not None and gate.path == stale and stale.stat().st_size == 4096
    assert pages.open("cuda:0") is gate
    pages.close_all()
    assert not stale.exists()
    assert GatePages(None).open("cuda:0") is None  # serve without --device-gate
