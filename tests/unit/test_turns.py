"""Whose turn a bubble is (``freeride.serve.turns``), alone and through the scheduler (harness from test_scheduler)."""

from __future__ import annotations

from pathlib import Path

from test_scheduler import MS, Harness, done

from freeride import protocol as p
from freeride.serve.probes import PROBE_AFTER_BUBBLES, Probes
from freeride.serve.tasks import TaskRecord
from freeride.serve.turns import PACK_ROOM_NS, Turns


def _task(task_id: int, estimate_ns: int, *, fill: bool = False, packs: bool = False) -> TaskRecord:
    t = TaskRecord(
        task_id=task_id,
        spec=p.IterativeSpec(target="m:C", fill=fill),
        name=f"t{task_id}",
        checkpoint_path=Path("/x"),
    )
    t.place("cpu:0")
    t.ready(estimate_ns=estimate_ns)
    t.packs = packs
    return t


def _ids(pairs: list[tuple[int, TaskRecord]]) -> list[int]:
    return [t.task_id for _, t in pairs]


def test_tasks_take_turns_round_robin_with_fillers_after_every_other() -> None:
    tasks = [_task(1, MS, fill=True), _task(2, MS), _task(3, MS)]
    turns = Turns(Probes())
    assert _ids(turns.order(tasks, start=True)) == [2, 3, 1]
    turns.served(1, len(tasks))  # task 2, at place 1, was served: task 3 is next
    assert _ids(turns.order(tasks, start=True)) == [3, 2, 1]
    assert [k for k, _ in turns.order(tasks, start=False)] == [0, 2, 1]


def test_a_filler_due_a_probe_comes_first_at_a_bubbles_start_only() -> None:
    probes = Probes()
    tasks = [_task(1, MS), _task(2, MS, fill=True)]
    for _ in range(PROBE_AFTER_BUBBLES - 1):
        probes.bubble_started(20 * MS)
        probes.tail_refused(2)
    turns = Turns(probes)
    assert _ids(turns.order(tasks, start=True)) == [2, 1]
    assert _ids(turns.order(tasks, start=False)) == [1, 2]


def test_offers_go_to_tasks_that_fit_and_to_packing_ones_and_count_the_rest_as_shut_out() -> None:
    probes = Probes()
    probes.bubble_started(20 * MS)
    big, small, packing, resting = _task(1, 9 * MS), _task(2, 2 * MS), _task(3, 9 * MS, packs=True), _task(4, MS)
    resting.runnable = False
    offers = Turns(probes).offers([big, small, packing, resting], remaining_ns=5 * MS, fresh=True, passed=())
    assert [(o.task.task_id, o.probe) for o in offers] == [(2, False), (3, False)]
    assert probes.no_fit(1)[0] == 1 and probes.no_fit(3) == (0, "")
    tail = Turns(probes).offers([packing], remaining_ns=PACK_ROOM_NS - 1, fresh=False, passed=())
    assert list(tail) == []  # too little left for any piece
    assert list(Turns(probes).offers([small], remaining_ns=5 * MS, fresh=True, passed={2})) == []


def test_a_task_whose_runner_refuses_a_grant_does_not_pass_its_turns_to_one_task_only() -> None:
    """A task placed here whose worker cannot take a grant (gone, not yet known to be) is passed over; the
    bubble goes to the next in turn, and the turns go on from that one, so every other task still gets its
    bubbles in turn."""
    h = Harness()
    gone = h.task(1, 2 * MS)
    assert gone.runner is not None
    gone.runner.grant = lambda grant: False  # type: ignore[method-assign]
    tasks = {2: h.task(2, 2 * MS), 3: h.task(3, 2 * MS)}
    served = []
    for step in range(4):
        ev = h.started(20 * MS, step=step)
        task_id, grant = h.grants()[-1]
        served.append(task_id)
        h.ended(ev, 20 * MS)
        h.report(tasks[task_id], done(tasks[task_id], grant, reason="revoked", busy=18 * MS))
    assert served == [2, 3, 2, 3]
