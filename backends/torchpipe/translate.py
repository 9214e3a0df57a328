"""torch.distributed.pipelining's action lists as FreeRide schedules (pure, no torch).

torch writes an action as ``1F0`` / ``1I0`` / ``1W0`` where ``1`` is the
*stage index* (a virtual stage when a rank holds several) and the letter is a
``_ComputationType`` value: ``F`` forward, ``B`` full backward, ``I`` the
input-gradient backward and ``W`` the weight-gradient backward of zero-bubble
schedules, plus communication and sharding entries (``SEND_F``, ``RECV_B``,
``UNSHARD``, ``REDUCE_GRAD``...) that are not compute. FreeRide writes
``rank kind micro-batch [chunk]``, with ``B`` standing for the input-gradient
part whenever the schedule also has the ``W`` (:class:`freeride.backends.schedule.Action`),
so torch's ``I`` and ``B`` both become our ``B``.

A rank's chunks are its stage indices in ascending order: ``chunk c`` of rank
``r`` is the rank's c-th stage. For loop-style placement (interleaved 1F1B:
stage ``s`` on rank ``s % p``) that is our ``chunk * p + rank``; for V-style
placement (ZBV, DualPipeV: rank ``r`` holds ``r`` and ``2p-1-r``) the chunks
name places faithfully but :func:`freeride.backends.schedule.simulate` would follow the
wrong neighbours, which :func:`loop_placed` tells.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from freeride.backends.schedule import Action, Kind, Schedule

__all__ = ["COMPUTE_KINDS", "NON_COMPUTE", "loop_placed", "to_schedule"]

COMPUTE_KINDS: dict[str, Kind] = {"F": "F", "B": "B", "I": "B", "W": "W"}
"""torch's compute letters -> ours (``I``, the input-gradient backward, is our ``B``)."""

NON_COMPUTE = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"})
"""Entries of torch's lists that do no compute (skipped)."""


def _chunks(stage_to_rank: Mapping[int, int]) -> dict[int, tuple[int, int]]:
    """stage index -> (rank, chunk)."""
    by_rank: dict[int, list[int]] = {}
    for stage, rank in stage_to_rank.items():
        by_rank.setdefault(rank, []).append(stage)
    return {s: (rank, c) for rank, stages in by_rank.items() for c, s in enumerate(sorted(stages))}


def loop_placed(stage_to_rank: Mapping[int, int], num_ranks: int) -> bool:
    """Whether every stage ``s`` sits on rank ``s % p`` (what the simulator models)."""
    return all(rank == stage % num_ranks for stage, rank in stage_to_rank.items())


def to_schedule(
    name: str,
    rows: Mapping[int, Sequence[tuple[int, str, int]]],
    *,
    stage_to_rank: Mapping[int, int],
    num_ranks: int,
    num_microbatches: int,
) -> Schedule:
    """Translate torch's per-rank action lists into a :class:`~freeride.backends.schedule.Schedule`.

    Args:
        name: The schedule's label (torch's class name).
        rows: Per pp rank, its actions as (stage index, type letter, micro-batch).
        stage_to_rank: torch's ``stage_index_to_group_rank``.
        num_ranks: Ranks in the pipeline group.
        num_microbatches: Micro-batches per step.

    Raises:
        ValueError: An unknown action type, an action on a stage the mapping does
            not place on that rank, or rows that are not a complete schedule.
    """
    if sorted(rows) != list(range(num_ranks)):
        raise ValueError(f"rows must list ranks 0..{num_ranks - 1}, got {sorted(rows)}")
    places = _chunks(stage_to_rank)
    chunks_per_rank = {rank for rank, _ in places.values()}
    if chunks_per_rank != set(range(num_ranks)):
        raise ValueError(f"stage_to_rank must place stages on ranks 0..{num_ranks - 1}, got {dict(stage_to_rank)}")
    num_chunks = max(c for _, c in places.values()) + 1
    actions: list[tuple[Action, ...]] = []
    for rank in range(num_ranks):
        row: list[Action] = []
        for stage, letter, mb in rows[rank]:
            if letter in NON_COMPUTE:
                continue
            kind = COMPUTE_KINDS.get(letter)
            if kind is None:
                raise ValueError(f"unknown torch action type {letter!r} on rank {rank}")
            where = places.get(stage)
            if where is None or where[0] != rank:
                raise ValueError(f"rank {rank} lists {stage}{letter}{mb}, a stage it does not hold")
            row.append(Action(rank, kind, mb, where[1]))
        actions.append(tuple(row))
    return Schedule(name, num_ranks, num_microbatches, num_chunks, tuple(actions))
