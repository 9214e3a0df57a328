"""The per-device scheduler's arms and whose turn they are: tasks of unknown step time, tasks due a probe,
programs and fillers (harness from test_scheduler_arming).
"""

from __future__ import annotations

from test_scheduler_arming import MS, Harness, done

from freeride import protocol as p
from freeride.serve.scheduler import PROBE_AFTER_BUBBLES


def test_an_unknown_step_time_next_in_turn_leaves_the_next_bubble_unarmed() -> None:
    h = Harness()
    h.task(1, 2 * MS, armable=False)  # a worker whose socket refuses the arm
    h.task(2, -1)  # unknown: it probes at a bubble's start, by Grant
    h.task(3, 2 * MS)
    assert h.arms() == []  # task 3 is not armed in task 2's place


def test_a_program_is_never_armed_and_gets_its_turn_at_a_bubbles_start() -> None:
    h = Harness()
    h.task(1, 2 * MS, program=True)  # a program is resumed by the manager, never armed
    h.task(2, 2 * MS)
    assert h.arms() == [] and h.grants() == []  # its turn comes with the next bubble's start
    h.started(20 * MS)
    assert [t for t, _ in h.grants()] == [1]


def test_an_armed_task_does_not_keep_a_task_of_unknown_step_time_out_of_every_bubble() -> None:
    """A task restarted from its checkpoint knows no step time; one armed for every bubble once kept it out."""
    h = Harness()
    known = h.task(1, 2 * MS)
    [(_, arm)] = h.arms()
    b = h.started(20 * MS)
    h.ended(b, 20 * MS)
    h.report(known, done(known, arm.grant_id, reason="revoked", busy=18 * MS))
    fresh = h.task(2, -1)  # (re)started: its step time is unknown
    answered = {arm.grant_id}
    served = []
    for _ in range(4):
        b = h.started(20 * MS)
        for tid, grant_id, _ in _held(h, answered):
            served.append(tid)
            t = fresh if tid == 2 else known
            t.estimate_ns = t.estimate_ns if t.estimate_ns > 0 else 3 * MS  # what its first step tells
            h.report(t, done(t, grant_id, reason="revoked", busy=18 * MS, armed=tid == 1))
        h.ended(b, 20 * MS)
    assert 2 in served, served
    # once its step time is known, the two take turns at being armed
    assert [t for t, _ in h.arms()][-2:] in ([1, 2], [2, 1])


def test_a_task_due_for_a_probe_is_not_armed() -> None:
    h = Harness()
    t1 = h.task(1, 30 * MS)  # never fits a 20 ms bubble
    answered: set[int] = set()
    for _ in range(PROBE_AFTER_BUBBLES + 2):
        b = h.started(20 * MS)
        for _, grant_id, probe in _held(h, answered):
            h.report(t1, done(t1, grant_id, armed=not probe))
        h.ended(b, 20 * MS)
    assert any(g.probe for _, g in h.grants()), "a task that never fits is still probed now and then"


def _held(h: Harness, answered: set[int]) -> list[tuple[int, int, bool]]:
    """Grants and arms out not answered yet, as (task id, grant id, probe): what holds the bubble just started.

    An arm out is honoured at a bubble's start; a worker known to hear the rank gets no Grant for it.
    """
    disarmed = {m.grant_id for _, m in h.sent if isinstance(m, p.Disarm)}
    held = []
    for tid, m in h.sent:
        if isinstance(m, p.Grant | p.Arm) and m.grant_id not in answered and m.grant_id not in disarmed:
            answered.add(m.grant_id)
            held.append((tid, m.grant_id, isinstance(m, p.Grant) and m.probe))
    return held


def test_a_filler_is_armed_only_when_no_other_task_can_be() -> None:
    h = Harness()
    filler = h.task(1, 1 * MS, fill=True)
    assert [t for t, _ in h.arms()] == [filler.task_id]  # alone, it is armed as soon as it is ready
    big = h.task(2, 8 * MS)
    ev = h.started(20 * MS)  # the filler's arm, once out, is honoured
    h.ended(ev, 20 * MS)
    h.report(filler, done(filler, h.arms()[0][1].grant_id, reason="revoked", busy=19 * MS))
    for _ in range(3):  # from then on, whoever was served last, the long-step task is armed
        assert h.arms()[-1][0] == big.task_id
        ev = h.started(20 * MS)
        h.ended(ev, 20 * MS)
        h.report(big, done(big, h.arms()[-2][1].grant_id, reason="revoked", busy=16 * MS))
    assert [t for t, _ in h.arms()[1:]] == [big.task_id] * 4


def test_a_filler_due_a_probe_leaves_the_next_bubble_unarmed_and_gets_its_start() -> None:
    """The long-step task is armed for every bubble; the filler's estimate fits none of the tails it leaves.
    Once the filler is due a probe, the next bubble is armed for no one, and its start is the filler's."""
    h = Harness()
    big = h.task(1, 8 * MS)
    filler = h.task(2, 5 * MS, fill=True)
    for i in range(PROBE_AFTER_BUBBLES - 1):
        arm = h.arms()[-1]
        assert arm[0] == big.task_id, i
        ev = h.started(20 * MS)
        h.clock.advance(16 * MS)
        h.report(big, done(big, arm[1].grant_id, busy=16 * MS))  # 4 ms left: the filler's 5 ms do not fit
        assert not [g for t, g in h.grants() if t == filler.task_id]
        h.ended(ev, 20 * MS)
    arms = len(h.arms())
    ev = h.started(20 * MS)
    assert len(h.arms()) == arms  # nobody was armed for this bubble
    task_id, grant = h.grants()[-1]
    assert task_id == filler.task_id and grant.probe
