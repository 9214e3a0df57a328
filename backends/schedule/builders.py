"""Schedule builders: GPipe, 1F1B and interleaved 1F1B as the frameworks order them, and forward-only steps."""

from __future__ import annotations

from collections.abc import Sequence

from freeride.backends.schedule.values import Action, Schedule, check_sizes

__all__ = [
    "gpipe",
    "one_f_one_b",
    "interleaved",
    "interleaved_from_table",
    "forward_only",
    "SCHEDULE_NAMES",
    "build_schedule",
]


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards in micro-batch order (as torch's ``ScheduleGPipe``)."""
    check_sizes(num_stages=num_stages, num_microbatches=num_microbatches)
    rows = tuple(
        tuple(Action(s, "F", mb) for mb in range(num_microbatches))
        + tuple(Action(s, "B", mb) for mb in range(num_microbatches))
        for s in range(num_stages)
    )
    return Schedule("gpipe", num_stages, num_microbatches, 1, rows)


def one_f_one_b(num_stages: int, num_microbatches: int) -> Schedule:
    """Non-interleaved 1F1B as Megatron-core runs it (and DeepSpeed's ``TrainSchedule`` orders it).

    Rank ``s`` runs ``min(p - s - 1, m)`` warm-up forwards, then alternates one forward and
    one backward, then drains the remaining backwards.
    """
    check_sizes(num_stages=num_stages, num_microbatches=num_microbatches)
    p, m = num_stages, num_microbatches
    rows: list[tuple[Action, ...]] = []
    for s in range(p):
        warm = min(p - s - 1, m)
        row = [Action(s, "F", mb) for mb in range(warm)]
        for i in range(m - warm):
            row += [Action(s, "F", warm + i), Action(s, "B", i)]
        row += [Action(s, "B", mb) for mb in range(m - warm, m)]
        rows.append(tuple(row))
    return Schedule("1f1b", p, m, 1, tuple(rows))


def interleaved(num_stages: int, num_microbatches: int, num_chunks: int) -> Schedule:
    """Megatron-core's interleaved 1F1B with ``microbatch_group_size_per_vp_stage = p``.

    Forwards follow Megatron's schedule table (groups of ``p`` micro-batches, chunk by
    chunk); the k-th backward runs the k-th table entry on the mirrored chunk ``v-1-c``.
    Rank ``s`` starts with ``2 (p - s - 1) + (v - 1) p`` warm-up forwards (capped at ``m v``).
    Megatron never runs this at ``p = 1`` (it has no pipeline there); the same rules still apply.

    Raises:
        ValueError: ``num_microbatches`` is not a multiple of ``num_stages`` (Megatron rejects it).
    """
    check_sizes(num_stages=num_stages, num_microbatches=num_microbatches, num_chunks=num_chunks)
    p, m, v = num_stages, num_microbatches, num_chunks
    if m % p:
        raise ValueError(f"num_microbatches ({m}) must be a multiple of num_stages ({p}) for interleaved")
    table = [(mb, c) for g in range(0, m, p) for c in range(v) for mb in range(g, g + p)]
    return interleaved_from_table(p, m, v, table, group=p)


def interleaved_from_table(
    num_stages: int, num_microbatches: int, num_chunks: int, table: Sequence[tuple[int, int]], *, group: int
) -> Schedule:
    """Interleaved 1F1B from a forward table of ``(micro-batch, chunk)`` entries.

    The k-th backward runs the k-th table entry on the mirrored chunk ``v-1-c``; rank
    ``s`` starts with ``2 (p - s - 1) + (v - 1) group`` warm-up forwards (capped at
    ``m v``). :func:`interleaved` is the case ``group = p``; other group sizes use the
    table the framework itself computes.
    """
    p, m, v = num_stages, num_microbatches, num_chunks
    total = m * v
    rows: list[tuple[Action, ...]] = []
    for s in range(p):
        warm = min(2 * (p - s - 1) + (v - 1) * group, total)
        fwd = [Action(s, "F", mb, c) for mb, c in table]
        bwd = [Action(s, "B", mb, v - 1 - c) for mb, c in table]
        row = fwd[:warm]
        for k in range(total - warm):
            row += [fwd[warm + k], bwd[k]]
        row += bwd[total - warm :]
        rows.append(tuple(row))
    return Schedule("interleaved", p, m, v, tuple(rows))


def forward_only(schedule: Schedule) -> Schedule:
    """The forward-only step (evaluation, inference) of ``schedule``: each rank's forwards, in its order.

    A rank runs its forwards in the order it would in training (Megatron's
    forward-only 1F1B and interleaved calls do), with no backward between them,
    so the pipeline fills once and drains once. The name gets ``"-forward"``.
    """
    rows = tuple(tuple(a for a in row if a.kind == "F") for row in schedule.actions)
    return Schedule(
        f"{schedule.name}-forward",
        schedule.num_stages,
        schedule.num_microbatches,
        schedule.num_chunks,
        rows,
        forward_only=True,
    )


SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")
"""The names :func:`build_schedule` knows."""


def build_schedule(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> Schedule:
    """Build the schedule called ``name`` (one of :data:`SCHEDULE_NAMES`).

    Raises:
        ValueError: Unknown name, or ``num_chunks != 1`` for a non-interleaved schedule.
    """
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"name must be one of {SCHEDULE_NAMES}, got {name!r}")
    if name == "interleaved":
        return interleaved(num_stages, num_microbatches, num_chunks)
    if num_chunks != 1:
        raise ValueError(f"num_chunks must be 1 for {name!r}, got {num_chunks}")
    return gpipe(num_stages, num_microbatches) if name == "gpipe" else one_f_one_b(num_stages, num_microbatches)
