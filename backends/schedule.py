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
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

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

logger = logging.getLogger(__name__)

Kind = Literal["F", "B", "W"]
"""Forward, backward (input gradient only when the schedule has a W for it), weight gradient."""

_KINDS: tuple[Kind, ...] = ("F", "B", "W")
_ACTION_RE = re.compile(r"(\d+)([FBW])(\d+)(?:c(\d+))?")
# Gaps shorter than this share of the step are float noise from adding durations, not bubbles.
_REL_EPS = 1e-9


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """One compute action of one pipeline rank.

    Attributes:
        stage: Pipeline rank, ``0..p-1``.
        kind: ``"F"`` (forward), ``"B"`` (backward) or ``"W"`` (weight gradient). When the
            schedule also has the ``W`` of the same stage, micro-batch and chunk, ``B`` is
            only the input-gradient part of the backward (as in zero-bubble schedules).
        microbatch: Micro-batch id, ``0..m-1``.
        chunk: Model chunk of interleaved schedules; the virtual stage is ``chunk * p + stage``.
    """

    stage: int
    kind: Kind
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        for field_name in ("stage", "microbatch", "chunk"):
            if getattr(self, field_name) < 0:
                raise ValueError(f"Action.{field_name} must be >= 0, got {getattr(self, field_name)}")
        if self.kind not in _KINDS:
            raise ValueError(f"Action.kind must be one of {_KINDS}, got {self.kind!r}")

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind}{self.microbatch}"
        return f"{text}c{self.chunk}" if self.chunk else text

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse the ``2F0`` / ``2F0c1`` / ``2W0`` notation.

        Raises:
            ValueError: ``text`` is not an action.
        """
        match = _ACTION_RE.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"not an action in 2F0 notation: {text!r}")
        stage, kind, microbatch, chunk = match.groups()
        return cls(int(stage), _KINDS["FBW".index(kind)], int(microbatch), int(chunk or 0))


@dataclass(frozen=True, slots=True)
class Schedule:
    """The per-rank execution order of one training step.

    Attributes:
        name: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or any label of a hand-written schedule.
        num_stages: Pipeline ranks ``p``.
        num_microbatches: Micro-batches ``m`` per step.
        num_chunks: Model chunks per rank ``v`` (1 unless interleaved).
        actions: ``actions[rank]`` in execution order; each rank runs one forward and one
            backward of every (micro-batch, chunk), and at most one weight-gradient pass.
        forward_only: The step only runs forwards (evaluation, inference): each rank runs
            one forward of every (micro-batch, chunk) and nothing else.
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    actions: tuple[tuple[Action, ...], ...]
    forward_only: bool = False

    def __post_init__(self) -> None:
        _check_sizes(num_stages=self.num_stages, num_microbatches=self.num_microbatches, num_chunks=self.num_chunks)
        if len(self.actions) != self.num_stages:
            raise ValueError(f"actions: {len(self.actions)} ranks listed for num_stages={self.num_stages}")
        places = [(mb, chunk) for mb in range(self.num_microbatches) for chunk in range(self.num_chunks)]
        kinds = ("F",) if self.forward_only else ("B", "F")
        expected = sorted((kind, *place) for kind in kinds for place in places)
        for rank, row in enumerate(self.actions):
            wrong = [str(a) for a in row if a.stage != rank]
            if wrong:
                raise ValueError(f"actions: rank {rank} lists actions of other ranks: {wrong}")
            passes = sorted((a.kind, a.microbatch, a.chunk) for a in row if a.kind != "W")
            weights = [(a.microbatch, a.chunk) for a in row if a.kind == "W"]
            if passes != expected or len(set(weights)) != len(weights) or not set(weights) <= set(places):
                what = "F" if self.forward_only else "F and B"
                raise ValueError(
                    f"actions: rank {rank} must run {what} of each of {self.num_microbatches} "
                    f"micro-batches x {self.num_chunks} chunks exactly once (and W at most once)"
                )
            if self.forward_only and weights:
                raise ValueError(f"actions: rank {rank} of a forward-only schedule lists W passes")

    def to_csv(self) -> str:
        """One line per rank, its actions in ``2F0`` notation separated by commas."""
        return "".join(",".join(map(str, row)) + "\n" for row in self.actions)

    @property
    def has_weight_passes(self) -> bool:
        """Whether any rank runs a separate weight-gradient pass (``W``)."""
        return any(a.kind == "W" for row in self.actions for a in row)

    @classmethod
    def from_csv(cls, text: str, *, name: str, num_microbatches: int, num_chunks: int = 1) -> Schedule:
        """Read a schedule written by :meth:`to_csv` (row ``r`` holds rank ``r``'s actions).

        Raises:
            ValueError: A cell is not an action, or the rows are not a complete schedule.
        """
        rows = [line for line in text.splitlines() if line.strip()]
        actions = tuple(tuple(Action.parse(cell) for cell in row.split(",") if cell.strip()) for row in rows)
        return cls(name, len(actions), num_microbatches, num_chunks, actions)


def _check_sizes(**sizes: int) -> None:
    for field_name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{field_name} must be >= 1, got {value}")


def gpipe(num_stages: int, num_microbatches: int) -> Schedule:
    """All forwards, then all backwards in micro-batch order (as torch's ``ScheduleGPipe``)."""
    _check_sizes(num_stages=num_stages, num_microbatches=num_microbatches)
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
    _check_sizes(num_stages=num_stages, num_microbatches=num_microbatches)
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
    _check_sizes(num_stages=num_stages, num_microbatches=num_microbatches, num_chunks=num_chunks)
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


@dataclass(frozen=True, slots=True)
class BubbleWindow:
    """An idle window of one rank within a step.

    Attributes:
        stage: Pipeline rank.
        index: Position among this rank's kept windows of the step, in time order.
        start: Seconds from step start.
        duration: Seconds.
        before: The action that ends the bubble; ``None`` for the tail bubble.
    """

    stage: int
    index: int
    start: float
    duration: float
    before: Action | None

    @property
    def end(self) -> float:
        """Seconds from step start at which the bubble ends."""
        return self.start + self.duration


def bubbles(timeline: Timeline, *, min_duration: float = 0.0) -> tuple[tuple[BubbleWindow, ...], ...]:
    """Per rank, the idle windows between step start (0) and the makespan.

    The head (0 to the first action) and the tail (last action to the makespan) count.
    Windows of ``min_duration`` or less are dropped; so are gaps within float noise
    (``1e-9`` of the makespan). Indices stay dense over the kept windows.
    """
    threshold = max(min_duration, _REL_EPS * timeline.makespan)
    result: list[tuple[BubbleWindow, ...]] = []
    for rank, row in enumerate(timeline.per_rank):
        windows: list[BubbleWindow] = []
        edges: Iterable[tuple[float, float, Action | None]] = zip(
            [0.0, *(t.end for t in row)],
            [*(t.start for t in row), timeline.makespan],
            [*(t.action for t in row), None],
            strict=True,
        )
        for start, end, before in edges:
            if end - start > threshold:
                windows.append(BubbleWindow(rank, len(windows), start, end - start, before))
        result.append(tuple(windows))
    return tuple(result)


def bubble_fraction(timeline: Timeline, stage: int | None = None) -> float:
    """Idle share of the step for ``stage``, or the mean over ranks when ``stage`` is None.

    Raises:
        ValueError: ``stage`` is out of range.
    """
    p = len(timeline.per_rank)
    if stage is not None and not 0 <= stage < p:
        raise ValueError(f"stage must be in 0..{p - 1}, got {stage}")
    if timeline.makespan <= 0:
        return 0.0
    ranks = range(p) if stage is None else (stage,)
    idle = [timeline.makespan - sum(t.end - t.start for t in timeline.per_rank[r]) for r in ranks]
    return sum(idle) / (len(idle) * timeline.makespan)


def bubbles_to_text(windows: tuple[tuple[BubbleWindow, ...], ...]) -> str:
    """A stable, readable dump of :func:`bubbles`: one line per window (used by golden files)."""
    lines = ["# stage index start duration before"]
    for w in (window for row in windows for window in row):
        before = "-" if w.before is None else str(w.before)
        lines.append(f"{w.stage} {w.index} {w.start:.6f} {w.duration:.6f} {before}")
    return "\n".join(lines) + "\n"
