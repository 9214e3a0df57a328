"""Megatron-core's schedules as FreeRide schedules, and where megatron really waits.

:func:`megatron_schedule` gives the per-rank action order megatron runs.
Megatron does not receive right before the action that needs the data,
though: interleaved 1F1B without ``overlap_p2p_comm`` runs one *iteration*
(a warm-up forward, a steady-state forward plus backward, a cool-down
backward) and then makes one blocking p2p call that sends what the iteration
produced and receives everything the next iteration needs. A rank therefore
waits before an iteration for all of its inputs, and its outputs leave only
when the iteration is over. :func:`megatron_timeline` simulates exactly that;
1F1B (and interleaved with ``overlap_p2p_comm``, whose waits sit right before
each action) are iterations of one action, where it equals
:func:`backends.schedule.simulate`.
"""

from __future__ import annotations

from backends.megatron import _compat
from backends.schedule import (
    Action,
    Durations,
    Kind,
    Schedule,
    Timed,
    Timeline,
    interleaved,
    interleaved_from_table,
    one_f_one_b,
)

__all__ = ["iterations", "megatron_schedule", "megatron_timeline", "warmup_count"]


def warmup_count(schedule: Schedule, stage: int, group_size: int | None = None) -> int:
    """Forwards ``stage`` runs before its first backward (megatron's ``num_warmup_microbatches``)."""
    p, m, v = schedule.num_stages, schedule.num_microbatches, schedule.num_chunks
    if schedule.name != "interleaved":
        return min(p - stage - 1, m)
    group = p if group_size is None else group_size
    return min(2 * (p - stage - 1) + (v - 1) * group, m * v)


def megatron_schedule(name: str, p: int, m: int, v: int, group: int) -> Schedule:
    """The per-rank order megatron-core runs for ``1f1b`` or ``interleaved``.

    Megatron's default ``microbatch_group_size_per_vp_stage = p`` is exactly
    :func:`backends.schedule.interleaved`; other group sizes follow megatron's
    own schedule table.

    Raises:
        ValueError: Unknown name, or sizes megatron would reject.
    """
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name != "interleaved":
        raise ValueError(f"name must be '1f1b' or 'interleaved', got {name!r}")
    if group == p and m % p == 0:
        return interleaved(p, m, v)
    return interleaved_from_table(p, m, v, _compat.schedule_table(m, v, group), group=group)


def iterations(
    schedule: Schedule, stage: int, *, overlap_p2p_comm: bool = False, group_size: int | None = None
) -> tuple[int, ...]:
    """Lengths of the runs of actions ``stage`` executes between two blocking p2p calls.

    Interleaved without ``overlap_p2p_comm``: warm-up forwards alone, steady-state
    forward-backward pairs, cool-down backwards alone. Otherwise one action each.
    """
    row = schedule.actions[stage]
    if schedule.name != "interleaved" or overlap_p2p_comm:
        return (1,) * len(row)
    warm = warmup_count(schedule, stage, group_size)
    steady = len(row) // 2 - warm
    return (1,) * warm + (2,) * steady + (1,) * warm


Message = tuple[Kind, int, int]
"""(kind, micro-batch, virtual stage) of a finished action."""


def _needs(action: Action, p: int, num_virtual: int) -> Message | None:
    virtual = action.chunk * p + action.stage
    if action.kind == "F":
        return None if virtual == 0 else ("F", action.microbatch, virtual - 1)
    if virtual == num_virtual - 1:
        return ("F", action.microbatch, virtual)
    return ("B", action.microbatch, virtual + 1)


def megatron_timeline(schedule: Schedule, durations: Durations, groups: tuple[tuple[int, ...], ...]) -> Timeline:
    """Replay ``schedule`` with each rank's actions run in ``groups`` (see :func:`iterations`).

    A group starts when the rank is free and every input from another rank
    has arrived; its actions then run back to back; its outputs reach other
    ranks ``durations.comm`` after the group ends.

    Raises:
        ValueError: ``groups`` does not cover the rows, or the schedule deadlocks.
    """
    p = schedule.num_stages
    num_virtual = p * schedule.num_chunks
    if len(groups) != p or any(sum(g) != len(row) for g, row in zip(groups, schedule.actions, strict=True)):
        raise ValueError("groups must split every rank's row")
    sent: dict[Message, float] = {}
    cursor = [0] * p  # next group
    index = [0] * p  # next action
    free = [0.0] * p
    placed: list[list[Timed]] = [[] for _ in range(p)]
    while any(cursor[r] < len(groups[r]) for r in range(p)):
        progressed = False
        for rank in range(p):
            while cursor[rank] < len(groups[rank]):
                acts = schedule.actions[rank][index[rank] : index[rank] + groups[rank][cursor[rank]]]
                ready = free[rank]
                missing = False
                for action in acts:
                    need = _needs(action, p, num_virtual)
                    if need is None or need[2] % p == rank:
                        continue  # first stage, or produced earlier on this rank
                    if need not in sent:
                        missing = True
                        break
                    ready = max(ready, sent[need])
                if missing:
                    break
                t = ready
                for action in acts:
                    cost = durations.forward[rank] if action.kind == "F" else durations.backward[rank]
                    placed[rank].append(Timed(action, t, t + cost))
                    t += cost
                for action in acts:
                    sent[(action.kind, action.microbatch, action.chunk * p + rank)] = t + durations.comm
                free[rank] = t
                index[rank] += len(acts)
                cursor[rank] += 1
                progressed = True
        if not progressed:
            stuck = [str(schedule.actions[r][index[r]]) for r in range(p) if cursor[r] < len(groups[r])]
            raise ValueError(f"schedule {schedule.name!r} deadlocks in megatron's order at {stuck}")
    return Timeline(schedule, tuple(tuple(row) for row in placed), max(free))
