"""Megatron-core's schedules as FreeRide schedules, and where megatron really waits.

:func:`megatron_schedule` gives the per-rank action order megatron runs.
Megatron does not receive right before the action that needs the data,
though: interleaved 1F1B without ``overlap_p2p_comm`` runs one *iteration*
(a warm-up forward, a steady-state forward plus backward, a cool-down
backward) and then makes one blocking p2p call that sends what the iteration
produced and receives everything the next iteration needs. A rank therefore
waits before an iteration for all of its inputs, and its outputs leave only
when the iteration is over. :func:`iterations` gives those runs, which
:func:`freeride.backends.schedule.simulate` replays as its ``groups``; 1F1B (and
interleaved with ``overlap_p2p_comm``, whose waits sit right before each
action) are iterations of one action, the plain replay.
"""

from __future__ import annotations

from freeride.backends.megatron import _compat
from freeride.backends.schedule import Schedule, interleaved, interleaved_from_table, one_f_one_b
from freeride.backends.schedule import forward_only as forward_only_of

__all__ = ["iterations", "megatron_schedule", "warmup_count"]


def warmup_count(schedule: Schedule, stage: int, group_size: int | None = None) -> int:
    """Forwards ``stage`` runs before its first backward (megatron's ``num_warmup_microbatches``)."""
    p, m, v = schedule.num_stages, schedule.num_microbatches, schedule.num_chunks
    if schedule.name != "interleaved":
        return min(p - stage - 1, m)
    group = p if group_size is None else group_size
    return min(2 * (p - stage - 1) + (v - 1) * group, m * v)


def megatron_schedule(name: str, p: int, m: int, v: int, group: int, *, forward_only: bool = False) -> Schedule:
    """The per-rank order megatron-core runs for ``1f1b`` or ``interleaved``.

    Megatron's default ``microbatch_group_size_per_vp_stage = p`` is exactly
    :func:`freeride.backends.schedule.interleaved`; other group sizes follow megatron's
    own schedule table. With ``forward_only`` (megatron's ``forward_only=True`` calls:
    evaluation, inference), each rank runs its forwards in the same order and
    nothing else (:func:`freeride.backends.schedule.forward_only`).

    Raises:
        ValueError: Unknown name, or sizes megatron would reject.
    """
    if name == "1f1b":
        schedule = one_f_one_b(p, m)
    elif name != "interleaved":
        raise ValueError(f"name must be '1f1b' or 'interleaved', got {name!r}")
    elif group == p and m % p == 0:
        schedule = interleaved(p, m, v)
    else:
        schedule = interleaved_from_table(p, m, v, _compat.schedule_table(m, v, group), group=group)
    return forward_only_of(schedule) if forward_only else schedule


def iterations(
    schedule: Schedule, stage: int, *, overlap_p2p_comm: bool = False, group_size: int | None = None
) -> tuple[int, ...]:
    """Lengths of the runs of actions ``stage`` executes between two blocking p2p calls.

    Interleaved without ``overlap_p2p_comm``: warm-up forwards alone, steady-state
    forward-backward pairs, cool-down backwards alone. Otherwise (also forward-only,
    where every forward is a warm-up forward) one action each.
    """
    row = schedule.actions[stage]
    if schedule.name != "interleaved" or overlap_p2p_comm:
        return (1,) * len(row)
    warm = warmup_count(schedule, stage, group_size)
    steady = len(row) // 2 - warm
    return (1,) * warm + (2,) * steady + (1,) * warm
