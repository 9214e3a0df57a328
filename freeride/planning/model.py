"""``freeride plan``: how much a job's bubbles would harvest, from its shape or its profile.

The bubbles come from the schedule model (:func:`freeride.backends.schedule.simulate`
replays the job's schedule with its per-stage forward and backward times);
what side tasks fill of them, and what they take from training, from measured
runs (:mod:`freeride.planning.measured`, or a share the user measured); the cost
saving from the formula ``freeride report`` uses
(:func:`freeride.observe.report.cost_saving`). At larger sizes with a fixed
global batch, each pipeline gets fewer micro-batches as data parallelism
grows, so its bubble share grows::

    shape = JobShape(gpus=1024, pp=8, microbatches=16, forward=(1.0,) * 8, backward=(2.0,) * 8, step_time_s=12.0,
                     global_batch=1024, microbatch_size=8)
    plan = make_plan(shape, (TaskShare(task="resnet50-train", share=1.0, use=measured_for("resnet50-train")),),
                     PlanOptions())
    print(plan.text())

Everything here is pure: no clocks, no I/O (reading files is :mod:`freeride.cli.plan`'s job).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from freeride.backends.schedule import SCHEDULE_NAMES, Durations, Schedule, bubbles, build_schedule, simulate
from freeride.observe.report import Prices, cost_saving, price_ratio
from freeride.planning.measured import MeasuredUse

__all__ = [
    "SCALE_GPUS",
    "JobShape",
    "Plan",
    "PlanOptions",
    "ScaleRow",
    "StageShare",
    "TaskShare",
    "make_plan",
    "stage_shares",
]

SCALE_GPUS = (1024, 2048, 4096, 8192, 16384)
"""The sizes of the scale table."""
_DAY_S = 86_400.0
# a measured step this much shorter than the schedule's compute means the F/B times are wrong
_STEP_SLACK = 0.05


@dataclass(frozen=True, kw_only=True, slots=True)
class JobShape:
    """A pipeline-parallel training job, as the planner models it."""

    gpus: int
    """GPUs of the job: ``pp * tp * dp``."""
    pp: int
    """Pipeline stages ``p``."""
    microbatches: int
    """Micro-batches per pipeline per step ``m``."""
    tp: int = 1
    """GPUs per stage (tensor/context parallel); they share the stage's bubbles."""
    chunks: int = 1
    """Model chunks per stage ``v`` (interleaved schedules)."""
    schedule: str = "1f1b"
    """One of :data:`freeride.backends.schedule.SCHEDULE_NAMES`."""
    forward: tuple[float, ...]
    """Per stage, one micro-batch's forward (per chunk when interleaved): seconds, or ratios if not ``absolute``."""
    backward: tuple[float, ...]
    absolute: bool = True
    """Whether ``forward``/``backward`` are seconds; ratios are scaled to ``step_time_s``."""
    comm_s: float = 0.0
    """Latency added on every hand-over between stages (p2p send to receive)."""
    comm_source: str = "none given"
    """Where ``comm_s`` comes from (printed with the assumptions)."""
    step_time_s: float | None = None
    """Measured step time. Beyond the schedule's compute it is work outside the pipeline
    (optimizer, gradient all-reduce), counted busy on every stage."""
    global_batch: int | None = None
    """Samples per step; with ``microbatch_size``, fixes ``m`` at other sizes (``m = B / (b * dp)``)."""
    microbatch_size: int | None = None
    measured_share: tuple[float, ...] = ()
    """Per stage, the bubble share a profile measured (shown beside the model's)."""
    source: str = "shape given on the command line"
    """Where the shape came from (printed with the assumptions)."""

    def __post_init__(self) -> None:
        for name in ("gpus", "pp", "microbatches", "tp", "chunks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"schedule must be one of {SCHEDULE_NAMES}, got {self.schedule!r}")
        if self.gpus % (self.pp * self.tp):
            raise ValueError(
                f"gpus ({self.gpus}) must be a multiple of pp x tp ({self.pp} x {self.tp}): each data-parallel"
                " replica is one whole pipeline"
            )
        if self.schedule == "interleaved":
            if self.chunks < 2:
                raise ValueError("chunks must be >= 2 for the interleaved schedule (use 1f1b for one chunk)")
            if self.microbatches % self.pp:
                raise ValueError(
                    f"micro-batches ({self.microbatches}) must be a multiple of pp ({self.pp}) for the interleaved"
                    " schedule (Megatron rejects it)"
                )
        elif self.chunks != 1:
            raise ValueError(f"chunks must be 1 for the {self.schedule!r} schedule, got {self.chunks}")
        for name in ("forward", "backward"):
            values = getattr(self, name)
            if len(values) != self.pp:
                raise ValueError(f"{name} must list {self.pp} stages (or one value for all), got {len(values)}")
            if any(not (t > 0 and math.isfinite(t)) for t in values):
                raise ValueError(f"{name} times must be positive, got {values}")
        if not (self.comm_s >= 0 and math.isfinite(self.comm_s)):
            raise ValueError(f"p2p latency must be >= 0, got {self.comm_s}")
        if self.step_time_s is not None and not (self.step_time_s > 0 and math.isfinite(self.step_time_s)):
            raise ValueError(f"step time must be positive, got {self.step_time_s}")
        if not self.absolute and self.step_time_s is None:
            raise ValueError("forward/backward are ratios: give the step time (--step-time) to scale them")
        if (self.global_batch is None) != (self.microbatch_size is None):
            raise ValueError("give both the global batch and the micro-batch size, or neither")
        if self.global_batch is not None and self.microbatch_size is not None:
            expected = self.global_batch / (self.microbatch_size * self.dp)
            if expected != self.microbatches:
                raise ValueError(
                    f"global batch {self.global_batch} / (micro-batch size {self.microbatch_size} x data parallel"
                    f" {self.dp}) = {expected:g} micro-batches, not {self.microbatches}"
                )
        if self.measured_share and len(self.measured_share) != self.pp:
            raise ValueError(f"measured_share must list {self.pp} stages, got {len(self.measured_share)}")

    @property
    def dp(self) -> int:
        """Data-parallel replicas (whole pipelines)."""
        return self.gpus // (self.pp * self.tp)

    def at(self, gpus: int) -> JobShape:
        """The same job on ``gpus`` GPUs: ``m`` from the fixed global batch, or kept without one.

        Raises:
            ValueError: The job cannot run on ``gpus`` (the message says why).
        """
        if gpus % (self.pp * self.tp):
            raise ValueError(f"{gpus} GPUs is not a multiple of pp x tp = {self.pp * self.tp}")
        m = self.microbatches
        if self.global_batch is not None and self.microbatch_size is not None:
            dp = gpus // (self.pp * self.tp)
            if self.global_batch % (self.microbatch_size * dp):
                raise ValueError(
                    f"global batch {self.global_batch} does not split into {dp} replicas x micro-batches of"
                    f" {self.microbatch_size}"
                )
            m = self.global_batch // (self.microbatch_size * dp)
        return replace(self, gpus=gpus, microbatches=m, measured_share=())


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskShare:
    """One side task of the mix."""

    task: str
    share: float
    """Share of the bubble time given to it (the mix's shares add up to 1)."""
    use: MeasuredUse | None
    """What it filled of the bubbles it got, measured; None: no measurement known."""
    step_s: float | None = None
    """Its step time on the training device (profile-task estimates): bubbles shorter than one step are lost."""
    cheap_rate: float | None = None
    """Its steps/s alone on the cheap GPU (for the saving); None: one bubble second is worth one cheap-GPU second."""

    def __post_init__(self) -> None:
        if not 0.0 < self.share <= 1.0:
            raise ValueError(f"task {self.task}: share must be in (0, 1], got {self.share}")
        if self.step_s is not None and not self.step_s > 0:
            raise ValueError(f"task {self.task}: step time must be positive, got {self.step_s}")
        if self.cheap_rate is not None and not self.cheap_rate > 0:
            raise ValueError(f"task {self.task}: throughput must be positive, got {self.cheap_rate}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    prices: Prices = field(default_factory=Prices)
    scale: tuple[int, ...] = SCALE_GPUS


@dataclass(frozen=True, kw_only=True, slots=True)
class StageShare:
    stage: int
    bubble_share: float
    """Idle share of the step, by the model."""
    usable_share: float
    """Of the step, what lies in bubbles long enough for the mix's steps (share-weighted)."""
    windows: int
    """Bubbles per step."""
    longest_s: float
    measured_share: float | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ScaleRow:
    gpus: int
    dp: int = 0
    microbatches: int = 0
    step_s: float = 0.0
    bubble_share: float = 0.0
    harvested_gpu_h_day: float = 0.0
    saving: float | None = None
    interference: float | None = None
    error: str = ""
    """Why the job cannot run at this size (the other fields are then empty)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    shape: JobShape
    tasks: tuple[TaskShare, ...]
    prices: Prices
    stages: tuple[StageShare, ...]
    job: ScaleRow
    """The job at its own size."""
    scale: tuple[ScaleRow, ...]
    assumptions: tuple[str, ...]

    @property
    def use(self) -> float:
        """Share-weighted measured use of the mix (0 for tasks without a measurement)."""
        return sum(t.share * (t.use.use if t.use else 0.0) for t in self.tasks)


def _schedule(shape: JobShape) -> Schedule:
    return build_schedule(shape.schedule, shape.pp, shape.microbatches, shape.chunks)


@dataclass(frozen=True, slots=True)
class _Times:
    """The job's per-micro-batch times in seconds, and its step time outside the pipeline."""

    durations: Durations
    outside_s: float


def _times(shape: JobShape) -> _Times:
    """Seconds per micro-batch pass (ratios scaled to the step time) and the rest of the step."""
    durations = Durations(forward=shape.forward, backward=shape.backward, comm=shape.comm_s)
    makespan = simulate(_schedule(shape), durations).makespan
    if not shape.absolute:
        assert shape.step_time_s is not None  # JobShape requires it for ratios
        compute = simulate(_schedule(shape), replace(durations, comm=0.0)).makespan
        # the latency's part of the step does not scale with the compute
        factor = (shape.step_time_s - (makespan - compute)) / compute
        if factor <= 0:
            raise ValueError(f"step time {shape.step_time_s:.4g} s leaves no compute beside the p2p latency")
        scaled = Durations(
            forward=tuple(t * factor for t in shape.forward),
            backward=tuple(t * factor for t in shape.backward),
            comm=shape.comm_s,
        )
        return _Times(scaled, 0.0)
    if shape.step_time_s is None:
        return _Times(durations, 0.0)
    if shape.step_time_s < makespan * (1 - _STEP_SLACK):
        raise ValueError(
            f"step time {shape.step_time_s:.4g} s is shorter than the schedule's compute {makespan:.4g} s"
            " (forward/backward per micro-batch x the schedule): one of them is wrong"
        )
    return _Times(durations, max(shape.step_time_s - makespan, 0.0))


def _usable(windows: list[float], step_s: float | None) -> float:
    """Bubble seconds a task with steps of ``step_s`` can start a step in."""
    return sum(w for w in windows if step_s is None or w >= step_s)


def stage_shares(
    shape: JobShape, tasks: tuple[TaskShare, ...] = (), *, times: _Times | None = None
) -> tuple[float, tuple[StageShare, ...]]:
    """The step time and each stage's bubble share of ``shape``, by the schedule model.

    Args:
        shape: The job.
        tasks: The mix; a bubble shorter than a task's step counts as unusable for it.
        times: Per-micro-batch times (default: those of ``shape``); the scale table
            keeps the job's own at every size.

    Returns:
        The step time in seconds and one entry per stage.
    """
    t = _times(shape) if times is None else times
    timeline = simulate(_schedule(shape), t.durations)
    step = timeline.makespan + t.outside_s
    windows = bubbles(timeline)
    out: list[StageShare] = []
    for rank, row in enumerate(timeline.per_rank):
        idle = timeline.makespan - sum(a.end - a.start for a in row)
        lengths = [w.duration for w in windows[rank]]
        usable = sum(task.share * _usable(lengths, task.step_s) for task in tasks) if tasks else idle
        out.append(
            StageShare(
                stage=rank,
                bubble_share=idle / step if step > 0 else 0.0,
                usable_share=min(usable, idle) / step if step > 0 else 0.0,
                windows=len(lengths),
                longest_s=max(lengths, default=0.0),
                measured_share=shape.measured_share[rank] if shape.measured_share else None,
            )
        )
    return step, tuple(out)


def _row(shape: JobShape, tasks: tuple[TaskShare, ...], prices: Prices, times: _Times) -> ScaleRow:
    step, stages = stage_shares(shape, times=times)
    bubble = sum(s.bubble_share for s in stages) / len(stages)
    interference: float | None = 0.0
    harvested_s = side_value_s = 0.0
    for task in tasks:
        # each task fills its measured share of the bubbles long enough for its steps
        _, alone = stage_shares(shape, (replace(task, share=1.0),), times=times)
        usable = sum(s.usable_share for s in alone) / len(alone)
        seconds = shape.gpus * _DAY_S * usable * task.share * (task.use.use if task.use else 0.0)
        harvested_s += seconds
        # FreeRide's formula: the work W_i priced as the cheap-GPU seconds W_i / R_i it would take there
        if task.step_s is not None and task.cheap_rate is not None:
            seconds *= 1.0 / task.step_s / task.cheap_rate
        side_value_s += seconds
        if interference is not None and task.use is not None and task.use.interference is not None:
            interference += task.share * task.use.interference
        else:
            interference = None
    saving = cost_saving(
        side_value_s=side_value_s,
        k=price_ratio(prices, shape.gpus),
        training_s=_DAY_S * (1.0 + (interference or 0.0)),
        vanilla_s=_DAY_S,
    )
    return ScaleRow(
        gpus=shape.gpus,
        dp=shape.dp,
        microbatches=shape.microbatches,
        step_s=step,
        bubble_share=bubble,
        harvested_gpu_h_day=harvested_s / 3600.0,
        saving=saving,
        interference=interference,
    )


def make_plan(shape: JobShape, tasks: tuple[TaskShare, ...], options: PlanOptions) -> Plan:
    """Model ``shape``'s bubbles, what ``tasks`` harvest of them, and the same at the scale table's sizes.

    Raises:
        ValueError: The shape's times do not fit its step time, or the mix's shares do not add up to 1.
    """
    if tasks and not math.isclose(sum(t.share for t in tasks), 1.0, abs_tol=1e-6):
        raise ValueError(f"the task shares must add up to 1, got {sum(t.share for t in tasks):g}")
    if len({t.task for t in tasks}) != len(tasks):
        raise ValueError("a task is named twice in the mix")
    times = _times(shape)
    _, stages = stage_shares(shape, tasks, times=times)
    job = _row(shape, tasks, options.prices, times)
    rows: list[ScaleRow] = []
    for gpus in options.scale:
        try:
            rows.append(_row(shape.at(gpus), tasks, options.prices, times))
        except ValueError as exc:
            rows.append(ScaleRow(gpus=gpus, error=str(exc)))
    return Plan(
        shape=shape,
        tasks=tasks,
        prices=options.prices,
        stages=stages,
        job=job,
        scale=tuple(rows),
        assumptions=_assumptions(shape, tasks, times, options.prices),
    )


def _assumptions(shape: JobShape, tasks: tuple[TaskShare, ...], times: _Times, prices: Prices) -> tuple[str, ...]:
    fwd = ", ".join(f"{t * 1e3:.3g}" for t in times.durations.forward)
    bwd = ", ".join(f"{t * 1e3:.3g}" for t in times.durations.backward)
    out = [
        f"shape: {shape.source}",
        f"bubbles: the schedule model (freeride.backends.schedule.simulate) of {shape.schedule}, p={shape.pp},"
        f" m={shape.microbatches}"
        + (f", v={shape.chunks}" if shape.chunks > 1 else "")
        + f"; per micro-batch forward [{fwd}] ms, backward [{bwd}] ms per stage"
        + ("" if shape.absolute else " (ratios scaled to the step time)")
        + f"; p2p latency {shape.comm_s * 1e3:.3g} ms per hand-over ({shape.comm_source}); no jitter",
        f"outside the pipeline (optimizer, gradient all-reduce): {times.outside_s * 1e3:.4g} ms per step, counted"
        " busy on every stage and kept the same at every size (a larger all-reduce would lower the bubble share)",
        "scale: "
        + (
            f"global batch {shape.global_batch} fixed, micro-batch size {shape.microbatch_size}: m = B / (b x dp)"
            " shrinks as data parallelism grows; per micro-batch times unchanged"
            if shape.global_batch is not None
            else "no global batch given: m per pipeline kept at every size (the global batch grows with dp),"
            " so the bubble share stays the same"
        ),
        "harvested GPU-hours/day: GPUs x 24 h x usable bubble share x measured use; a GPU's bubble counts"
        f" for every one of its tp={shape.tp} GPUs",
        "use and interference: measured shares, kept at every size; neither is modelled (interference comes"
        " from side steps running past bubble ends: longer, rarer bubbles at scale would likely lower it)",
    ]
    if shape.microbatches < shape.pp:
        out.append(
            f"m={shape.microbatches} < p={shape.pp}: the pipeline never fills; most of each stage's step is bubble"
        )
    for task in tasks:
        if task.use is None:
            out.append(f"task {task.task} ({task.share:.0%}): no measured use known: it counts as harvesting nothing")
        else:
            u = task.use
            inter = "-" if u.interference is None else f"{u.interference:.2%}"
            out.append(
                f"task {task.task} ({task.share:.0%}): use {u.use:.1%}, interference {inter} measured in {u.job},"
                f" {u.steps} steps ({u.source})"
            )
        if task.step_s is not None:
            out.append(f"task {task.task}: step {task.step_s * 1e3:.3g} ms; shorter bubbles count as unusable")
        if task.step_s is not None and task.cheap_rate is not None:
            out.append(
                f"task {task.task}: {1 / task.step_s:.4g} steps/s in bubbles vs {task.cheap_rate:g}/s alone on the"
                " cheap GPU"
            )
        else:
            out.append(f"task {task.task}: one harvested GPU-second is worth one cheap-GPU second (no throughputs)")
    out.append(
        f"saving: FreeRide's formula (as freeride report): (sum W_i/R_i / k - (T_fr - T_van)) / T_van over a day,"
        f" k = {prices.train_gpu_per_hour:g} $/h x GPUs / {prices.side_gpu_per_hour:g} $/h,"
        " T_fr - T_van = measured interference x T_van (a GPU does not preempt a running kernel)"
    )
    return tuple(out)
