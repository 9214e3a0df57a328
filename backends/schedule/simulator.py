"""The dry-run simulator: a schedule replayed with given per-rank durations, as early as dependencies allow.

:func:`simulate` places every action of a :class:`~freeride.backends.schedule.values.Schedule`
in time (for frameworks that block on a p2p call per iteration, in action groups)
and returns the :class:`Timeline` that bubble finding reads. Pure: no clocks, no I/O.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from freeride.backends.schedule.values import Action, Kind, Schedule

__all__ = ["Durations", "Groups", "Timed", "Timeline", "simulate"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Durations:
    """Compute and communication times for :func:`simulate`, in seconds.

    Attributes:
        forward: Per rank, one micro-batch forward (per chunk for interleaved schedules).
        backward: Per rank, one micro-batch backward (per chunk for interleaved schedules);
            in a schedule with ``W`` passes, its input-gradient part only.
        comm: Latency added on every dependency that crosses ranks.
        weight: Per rank, one weight-gradient pass (``W``); empty unless the schedule has them.
    """

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    comm: float = 0.0
    weight: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.forward or len(self.forward) != len(self.backward):
            raise ValueError("forward and backward must list the same, non-zero number of ranks")
        if self.weight and len(self.weight) != len(self.forward):
            raise ValueError(f"weight must list {len(self.forward)} ranks (or none), got {len(self.weight)}")
        for field_name, values in (("forward", self.forward), ("backward", self.backward), ("weight", self.weight)):
            if any(not t >= 0 for t in values):
                raise ValueError(f"{field_name} durations must be >= 0, got {values}")
        if not self.comm >= 0:
            raise ValueError(f"comm must be >= 0, got {self.comm}")

    @classmethod
    def uniform(
        cls, num_stages: int, forward: float, backward: float, comm: float = 0.0, weight: float | None = None
    ) -> Durations:
        """The same forward, backward (and weight-gradient) time on every rank."""
        weights = () if weight is None else (weight,) * num_stages
        return cls(forward=(forward,) * num_stages, backward=(backward,) * num_stages, comm=comm, weight=weights)

    def cost(self, rank: int, kind: Kind) -> float:
        """Seconds one ``kind`` pass takes on ``rank``."""
        if kind == "F":
            return self.forward[rank]
        return self.backward[rank] if kind == "B" else self.weight[rank]


@dataclass(frozen=True, slots=True)
class Timed:
    """An action placed in time (seconds from step start)."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Timeline:
    """The simulated step: every rank's actions in order, and the step length."""

    schedule: Schedule
    per_rank: tuple[tuple[Timed, ...], ...]
    makespan: float


Groups = Sequence[Sequence[int]]
"""Per rank, the lengths of the runs of actions it executes between two blocking p2p calls."""


def _dependency(action: Action, p: int, num_virtual: int) -> tuple[Kind, int, int] | None:
    """The (kind, micro-batch, virtual stage) an action waits for, if any."""
    virtual = action.chunk * p + action.stage
    if action.kind == "W":
        return ("B", action.microbatch, virtual)
    if action.kind == "F":
        return None if virtual == 0 else ("F", action.microbatch, virtual - 1)
    if virtual == num_virtual - 1:
        return ("F", action.microbatch, virtual)
    return ("B", action.microbatch, virtual + 1)


def _runs(schedule: Schedule, groups: Groups | None) -> list[list[tuple[Action, ...]]]:
    rows = schedule.actions
    if groups is None:
        return [[(a,) for a in row] for row in rows]
    if len(groups) != len(rows) or any(
        sum(sizes) != len(row) or any(n < 1 for n in sizes) for sizes, row in zip(groups, rows, strict=False)
    ):
        raise ValueError("groups must split every rank's row into runs of at least one action")
    runs: list[list[tuple[Action, ...]]] = []
    for sizes, row in zip(groups, rows, strict=True):
        bounds = list(itertools.accumulate(sizes, initial=0))
        runs.append([row[a:b] for a, b in itertools.pairwise(bounds)])
    return runs


def simulate(schedule: Schedule, durations: Durations, *, groups: Groups | None = None) -> Timeline:
    """Replay ``schedule`` as early as dependencies and per-rank order allow.

    F of a micro-batch on virtual stage ``u`` waits for its F on ``u-1``; B on ``u`` waits
    for its B on ``u+1``, and the last virtual stage's B for its own F; W waits for the B
    of the same virtual stage, and nothing waits for W. ``durations.comm`` is added when
    the two actions sit on different ranks.

    With ``groups``, each rank runs its actions in runs (Megatron's interleaved 1F1B
    without ``overlap_p2p_comm`` makes one blocking send-and-receive per iteration):
    a run starts when the rank is free and every input from another rank has arrived,
    its actions run back to back, and its outputs leave when the run is over. Runs of
    one action (the default) are the plain replay.

    Raises:
        ValueError: ``durations`` or ``groups`` do not match the schedule, or it deadlocks.
    """
    p = schedule.num_stages
    if len(durations.forward) != p:
        raise ValueError(f"durations list {len(durations.forward)} ranks, schedule has {p}")
    if schedule.has_weight_passes and not durations.weight:
        raise ValueError(f"schedule {schedule.name!r} has W passes: durations.weight is needed")
    runs = _runs(schedule, groups)
    num_virtual = p * schedule.num_chunks
    sent: dict[tuple[Kind, int, int], float] = {}  # when an output leaves its rank
    cursor = [0] * p
    free = [0.0] * p
    placed: list[list[Timed]] = [[] for _ in range(p)]
    while True:
        progressed = False
        for rank in range(p):
            while cursor[rank] < len(runs[rank]):
                run = runs[rank][cursor[rank]]
                ready = _ready(run, rank, p, num_virtual, sent, durations.comm)
                if ready is None:
                    break
                t = max(free[rank], ready)
                for action in run:
                    cost = durations.cost(rank, action.kind)
                    placed[rank].append(Timed(action, t, t + cost))
                    t += cost
                for action in run:
                    sent[(action.kind, action.microbatch, action.chunk * p + rank)] = t
                free[rank] = t
                cursor[rank] += 1
                progressed = True
        if all(cursor[r] == len(runs[r]) for r in range(p)):
            break
        if not progressed:
            stuck = [str(runs[r][cursor[r]][0]) for r in range(p) if cursor[r] < len(runs[r])]
            logger.debug("[simulate] %s deadlocks at %s", schedule.name, stuck)
            raise ValueError(f"schedule {schedule.name!r} deadlocks: ranks wait forever at {stuck}")
    makespan = max(free)
    return Timeline(schedule, tuple(tuple(row) for row in placed), makespan)


def _ready(
    run: tuple[Action, ...],
    rank: int,
    p: int,
    num_virtual: int,
    sent: dict[tuple[Kind, int, int], float],
    comm: float,
) -> float | None:
    """When every input of ``run`` from another rank has arrived; None: one is still missing."""
    ready = 0.0
    for i, action in enumerate(run):
        dep = _dependency(action, p, num_virtual)
        if dep is None:
            continue
        if dep[2] % p == rank:
            # produced on this rank: by an earlier run (done, as the rank is in order) or earlier in this one
            earlier = any((a.kind, a.microbatch, a.chunk * p + rank) == dep for a in run[:i])
            if dep not in sent and not earlier:
                return None
            continue
        if dep not in sent:
            return None
        ready = max(ready, sent[dep] + comm)
    return ready
