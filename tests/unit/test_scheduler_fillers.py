"""The per-device scheduler with fillers and packing tasks (harness from test_scheduler): who gets the
end of a bubble, and when a packing task is probed.
"""

from __future__ import annotations

import pytest
from test_scheduler import MS, Harness, done

from freeride.serve.scheduler import PROBE_AFTER_BUBBLES
from freeride.serve.tasks import TaskRecord


def test_a_filler_takes_a_bubble_only_after_the_other_tasks_gave_it_back() -> None:
    h = Harness()
    filler = h.task(1, 1 * MS, fill=True)  # placed first, and its short steps fit any bubble
    big = h.task(2, 8 * MS)
    for bubble in range(3):  # every bubble, whoever was served last: the long-step task first
        ev = h.started(20 * MS, step=bubble)
        assert h.grants()[-1][0] == big.task_id
        h.clock.advance(16 * MS)  # two of its steps; a third does not fit in the 4 ms left
        h.report(big, done(big, h.grants()[-1][1], busy=16 * MS))
        assert h.grants()[-1][0] == filler.task_id  # the end of the bubble goes to the filler
        h.clock.advance(3 * MS)
        h.report(filler, done(filler, h.grants()[-1][1], busy=3 * MS))
        h.ended(ev, 20 * MS)
    assert len(h.grants()) == 6


def test_a_filler_alone_on_its_device_takes_whole_bubbles() -> None:
    h = Harness()
    filler = h.task(1, 1 * MS, fill=True)
    h.started(20 * MS)
    assert h.grants()[-1][0] == filler.task_id


def test_a_packing_task_is_granted_what_is_left_though_its_whole_step_does_not_fit() -> None:
    """Its worker offers a smaller piece (fit_piece); one that does not pack is kept out as before."""
    for packs, estimate, granted in (
        (True, 5 * MS, True),
        (True, -1, True),
        (False, 5 * MS, False),
        (False, -1, False),
    ):
        h = Harness()
        big = h.task(1, 8 * MS)
        filler = h.task(2, estimate, fill=True)  # -1: not measured yet (an unmeasured kind only probes fresh bubbles)
        filler.packs = packs
        h.started(20 * MS)
        h.clock.advance(16 * MS)  # 4 ms left: the filler's whole 5 ms step does not fit
        h.report(big, done(big, h.grants()[-1][1], busy=16 * MS))
        assert (h.grants()[-1][0] == filler.task_id) is granted


def test_a_packing_task_whose_piece_cannot_be_split_gets_a_probe_now_and_then() -> None:
    """A packing task is granted bubbles its whole step does not fit; where its worker finds no piece that
    does (a partitioned task's optimizer chunk cannot be halved) and gives each back at once, the task
    would wait forever: it is counted as shut out, and gets a probe as any other task does."""
    h = Harness()
    t = h.task(1, 80 * MS)  # larger than any bubble
    t.packs = True
    for i in range(PROBE_AFTER_BUBBLES - 1):
        b = h.started(20 * MS, index=i)
        [(_, grant)] = h.grants()[-1:]
        assert not grant.probe  # granted as a packing task ...
        h.report(t, done(t, grant))  # ... and given back with no step
        h.ended(b, 20 * MS)
    h.started(20 * MS, index=99)
    assert h.grants()[-1][1].probe
    t.estimate_ns = 30 * MS
    h.report(t, done(t, h.grants()[-1][1], busy=30 * MS))  # it ran its step: no longer shut out
    b = h.started(20 * MS, index=100)
    assert not h.grants()[-1][1].probe


def test_a_packing_task_that_runs_pieces_is_never_probed() -> None:
    h = Harness()
    t = h.task(1, 80 * MS)
    t.packs = True
    for i in range(3 * PROBE_AFTER_BUBBLES):
        b = h.started(20 * MS, index=i)
        grant = h.grants()[-1][1]
        assert not grant.probe
        h.report(t, done(t, grant, busy=10 * MS))  # a piece that fit
        h.ended(b, 20 * MS)


def _starve_filler(h: Harness, big: TaskRecord, filler: TaskRecord, bubbles: int) -> None:
    """Bubbles whose start goes to ``big`` and whose 4 ms tail ``filler``'s 5 ms estimate does not fit."""
    for i in range(bubbles):
        b = h.started(20 * MS, index=i)
        assert h.grants()[-1][0] == big.task_id, i
        h.clock.advance(16 * MS)
        h.report(big, done(big, h.grants()[-1][1], busy=16 * MS))
        if h.grants()[-1][0] == filler.task_id:  # a packing filler is offered the tail: it finds no piece
            h.report(filler, done(filler, h.grants()[-1][1]))
        h.ended(b, 20 * MS)


def _filler_in_the_tails(h: Harness, big: TaskRecord, filler: TaskRecord, indices: range) -> None:
    """Bubbles whose start goes to ``big`` and whose 4 ms tail ``filler`` takes, with no probe."""
    for i in indices:
        b = h.started(20 * MS, index=i)
        assert h.grants()[-1][0] == big.task_id
        h.clock.advance(16 * MS)
        h.report(big, done(big, h.grants()[-1][1], busy=16 * MS))
        task_id, grant = h.grants()[-1]
        assert task_id == filler.task_id and not grant.probe
        h.clock.advance(3 * MS)
        h.report(filler, done(filler, grant, busy=3 * MS))
        h.ended(b, 20 * MS)


@pytest.mark.parametrize("packs", [False, True])
def test_a_filler_whose_estimate_keeps_it_out_of_every_tail_gets_a_probe_at_a_bubble_start(packs: bool) -> None:
    """A filler only gets what the other tasks leave of a bubble. One whose estimate (too high, or of a kind
    not measured yet) fits no tail was shut out for good: it never reached a bubble's start, where a probe
    corrects an estimate. It is counted as shut out at every tail its estimate kept it from, and once due
    gets one step at the start of a long bubble, ahead of the others."""
    h = Harness()
    big = h.task(1, 8 * MS)
    filler = h.task(2, 5 * MS, fill=True)
    filler.packs = packs
    _starve_filler(h, big, filler, PROBE_AFTER_BUBBLES - 1)
    b = h.started(20 * MS, index=PROBE_AFTER_BUBBLES)  # the PROBE_AFTER_BUBBLES-th it is kept out of
    task_id, grant = h.grants()[-1]
    assert task_id == filler.task_id and grant.probe
    filler.estimate_ns = 1 * MS  # its step, measured at last
    h.clock.advance(1 * MS)
    h.report(filler, done(filler, grant, busy=1 * MS))
    assert h.grants()[-1][0] == big.task_id  # the rest of the bubble: the other task's again
    h.clock.advance(16 * MS)
    h.report(big, done(big, h.grants()[-1][1], busy=16 * MS))
    h.ended(b, 20 * MS)
    # from here the filler fits the tails, and the bubbles' starts are the other task's
    _filler_in_the_tails(h, big, filler, range(PROBE_AFTER_BUBBLES + 1, 3 * PROBE_AFTER_BUBBLES))


def test_a_filler_that_fits_the_tails_is_never_probed() -> None:
    h = Harness()
    big = h.task(1, 8 * MS)
    filler = h.task(2, 1 * MS, fill=True)
    _filler_in_the_tails(h, big, filler, range(3 * PROBE_AFTER_BUBBLES))
