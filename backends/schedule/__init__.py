"""Pipeline schedules as plain values, a dry-run simulator, and bubble finding.

A schedule lists, for every pipeline rank, the compute actions it runs in
order, written in the ``2F0`` notation (rank 2, forward, micro-batch 0; a
model chunk other than 0 is appended as ``c1``). Zero-bubble schedules split a
backward in two: ``2B0`` computes the input gradient that rank 1 waits for and
``2W0`` the weight gradient that nobody waits for, so ``W`` can fill a bubble.
:func:`simulate` replays a schedule with given per-rank durations (and, for
frameworks that block on a p2p call per iteration, action groups) and
:func:`bubbles` reads the idle windows of each rank off the resulting timeline::

    timeline = simulate(one_f_one_b(4, 8), Durations.uniform(4, forward=1.0, backward=2.0))
    for window in bubbles(timeline)[0]:
        print(window.start, window.duration, window.before)

Everything here is pure: no framework imports, no clocks, no I/O.

The package re-exports, by concern: :mod:`~freeride.backends.schedule.values`
(actions and schedules), :mod:`~freeride.backends.schedule.builders` (GPipe,
1F1B, interleaved), :mod:`~freeride.backends.schedule.simulator` (the dry run)
and :mod:`~freeride.backends.schedule.windows` (bubble finding).
"""

from freeride.backends.schedule.builders import (
    SCHEDULE_NAMES,
    build_schedule,
    forward_only,
    gpipe,
    interleaved,
    interleaved_from_table,
    one_f_one_b,
)
from freeride.backends.schedule.simulator import Durations, Groups, Timed, Timeline, simulate
from freeride.backends.schedule.values import Action, Kind, Schedule
from freeride.backends.schedule.windows import BubbleWindow, bubble_fraction, bubbles, bubbles_to_text

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "BubbleWindow",
    "Durations",
    "Groups",
    "Kind",
    "Schedule",
    "Timed",
    "Timeline",
    "bubble_fraction",
    "bubbles",
    "bubbles_to_text",
    "build_schedule",
    "forward_only",
    "gpipe",
    "interleaved",
    "interleaved_from_table",
    "one_f_one_b",
    "simulate",
]
