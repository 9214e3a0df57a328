"""``freeride report``: what a traced run's bubbles held, what it cost, what it saved.

Reads a trace written by :class:`~freeride.observe.trace.TraceWriter` (``freeride serve
--trace``) and, optionally, the trace of a baseline run of the same job without
side tasks. Per stage it reports the bubble share (announced bubble time inside
training steps over step time) and the harvested share (side-task busy time
inside those bubbles over bubble time); for the job, the training slowdown
(median step time against the baseline's) and the cost saving by FreeRide's
formula::

    saving = (sum_i W_i / R_i / k - (T_fr - T_van)) / T_van

with W_i the work (steps) task i did, R_i its throughput (steps/s) alone on the
cheap GPU, k the price of the training GPUs over the price of one cheap GPU,
and T_fr / T_van the training time with FreeRide and without (the baseline's
median step time times the steps run). The first ``warmup_steps`` steps
(start-up: ranks waiting for each other) are left out of every number.
"""

from __future__ import annotations

import bisect
import fnmatch
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from freeride import protocol as p
from freeride.observe.cost import cost_line
from freeride.observe.timeline import Span, Trace
from freeride.units import format_ns

__all__ = [
    "Prices",
    "Report",
    "ReportOptions",
    "StageReport",
    "TaskReport",
    "build_report",
    "cost_saving",
    "parse_throughputs",
    "price_ratio",
]

# -- interval arithmetic ---------------------------------------------------------


def _merge(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def _intersect(a: list[Span], b: list[Span]) -> list[Span]:
    """Intersection of two sorted lists of disjoint spans."""
    out: list[Span] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _covered(region: list[Span], starts: list[int], span: Span) -> int:
    """Length of ``span`` inside ``region`` (sorted, disjoint; ``starts`` its start points)."""
    total = 0
    k = max(0, bisect.bisect_right(starts, span[0]) - 1)
    while k < len(region) and region[k][0] < span[1]:
        total += max(0, min(region[k][1], span[1]) - max(region[k][0], span[0]))
        k += 1
    return total


# -- the report ----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Prices:
    """GPU prices of the cost-saving formula."""

    train_gpu_per_hour: float = 3.96
    """Price of one training GPU per hour."""
    side_gpu_per_hour: float = 0.18
    """Price per hour of the cheap GPU the side tasks would otherwise run on."""
    train_gpus: int = 0
    """Training GPUs of the job; 0: the devices in the trace."""

    def __post_init__(self) -> None:
        for name in ("train_gpu_per_hour", "side_gpu_per_hour"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive price, got {value}")
        if self.train_gpus < 0:
            raise ValueError(f"train_gpus must be >= 0, got {self.train_gpus}")


def price_ratio(prices: Prices, train_gpus: int) -> float:
    """``k`` of the formula: the price of ``train_gpus`` training GPUs over the price of one cheap GPU."""
    return prices.train_gpu_per_hour * max(train_gpus, 1) / prices.side_gpu_per_hour


def cost_saving(*, side_value_s: float, k: float, training_s: float, vanilla_s: float) -> float | None:
    """FreeRide's cost saving, as a fraction of the training cost without FreeRide.

    Args:
        side_value_s: ``sum_i W_i / R_i``, the cheap-GPU seconds the side work would have taken.
        k: See :func:`price_ratio`.
        training_s: ``T_fr``, the training time with side tasks.
        vanilla_s: ``T_van``, the same training without them.

    Returns:
        The saving, or None when ``vanilla_s`` is not positive.
    """
    if vanilla_s <= 0:
        return None
    return (side_value_s / k - (training_s - vanilla_s)) / vanilla_s


@dataclass(frozen=True, kw_only=True, slots=True)
class ReportOptions:
    prices: Prices = field(default_factory=Prices)
    throughputs: tuple[tuple[str, float], ...] = ()
    """``(task name or glob, steps/s alone on the cheap GPU)``; the first match counts."""
    warmup_steps: int = 1
    """Steps left out at the start of each trace."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        for pattern, rate in self.throughputs:
            if not (rate > 0 and math.isfinite(rate)):
                raise ValueError(f"throughputs: {pattern} must have a positive throughput, got {rate}")


def parse_throughputs(pairs: list[str]) -> tuple[tuple[str, float], ...]:
    """``["pagerank-*=126.3"]`` -> ``(("pagerank-*", 126.3),)``.

    Raises:
        ValueError: a pair is not ``NAME=NUMBER``.
    """
    out: list[tuple[str, float]] = []
    for pair in pairs:
        name, sep, raw = pair.rpartition("=")
        try:
            rate = float(raw)
        except ValueError:
            rate = math.nan
        if not sep or not name or not math.isfinite(rate):
            raise ValueError(f"--side-throughput expects NAME=STEPS_PER_S, got {pair!r}")
        out.append((name, rate))
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageReport:
    device: str
    stage: int
    steps: int
    step_ns: int
    """Time in the steps counted."""
    bubble_ns: int
    """Announced bubble time inside those steps."""
    harvested_ns: int
    """Side-task busy time inside those bubbles."""
    interference_ns: int = 0
    """Side-task compute after bubble ends during those steps (what a GPU would take from training)."""
    idle_ns: int = 0
    """Bubble time of bubbles no side-task work reached (nothing fit, none granted, or left out)."""
    lead_ns: int = 0
    """In bubbles with side-task work: from the bubble's start to the first work (the start latency)."""
    tail_ns: int = 0
    """In bubbles with side-task work: from the last work's end to the bubble's end (a deadline before the
    bubble's real end, or a next step that did not fit)."""
    tail_past_ns: int = 0
    """The part of :attr:`tail_ns` after the end the rank predicted for its bubble: there no grant's deadline
    reaches (unless the guard's factor is above 1)."""
    gap_ns: int = 0
    """In bubbles with side-task work: between two grants' work."""

    @property
    def between_steps_ns(self) -> int:
        """Inside grants' spans but not in steps: the worker's own work between two steps (reading its
        sockets, fitting the next step, its accounting, each paid with caches a step has just used)."""
        rest = self.harvested_ns + self.idle_ns + self.lead_ns + self.tail_ns + self.gap_ns
        return max(0, self.bubble_ns - rest)

    @property
    def bubble_share(self) -> float | None:
        return self.bubble_ns / self.step_ns if self.step_ns else None

    @property
    def interference_share(self) -> float | None:
        """Interference as a share of the stage's training time."""
        return self.interference_ns / self.step_ns if self.step_ns else None

    @property
    def harvested_share(self) -> float | None:
        return self.harvested_ns / self.bubble_ns if self.bubble_ns else None


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskReport:
    task_id: int
    name: str
    device: str
    work: int
    """Steps done during the counted training steps."""
    busy_ns: int
    throughput_alone: float | None
    """Steps/s alone on the cheap GPU (given by the user)."""
    interference_ns: int = 0

    @property
    def cheap_gpu_s(self) -> float | None:
        """Time the cheap GPU would need for the same work."""
        return self.work / self.throughput_alone if self.throughput_alone else None


@dataclass(frozen=True, kw_only=True, slots=True)
class Report:
    stages: list[StageReport]
    tasks: list[TaskReport]
    steps: int
    """Training steps counted (after warm-up)."""
    median_step_ns: int | None
    baseline_median_step_ns: int | None
    training_s: float
    """T_fr: summed duration of the counted steps (slowest stage per step)."""
    k: float
    """Price of the training GPUs over the price of one cheap GPU."""
    train_gpus: int
    prices: Prices = field(default_factory=Prices)
    notes: tuple[str, ...] = ()
    costs: tuple[p.TrainingCost, ...] = ()
    """Each job's training cost as the manager measured it on the job's own steps (held back / harvested)."""

    @property
    def slowdown(self) -> float | None:
        if self.median_step_ns and self.baseline_median_step_ns:
            return self.median_step_ns / self.baseline_median_step_ns - 1.0
        return None

    @property
    def vanilla_s(self) -> float:
        """T_van: the same steps at the baseline's median pace (T_fr without a baseline)."""
        if self.median_step_ns and self.baseline_median_step_ns:
            return self.training_s * self.baseline_median_step_ns / self.median_step_ns
        return self.training_s

    @property
    def side_value_s(self) -> float:
        """Sum of W_i / R_i: cheap-GPU seconds the side work would have taken."""
        return sum(t.cheap_gpu_s or 0.0 for t in self.tasks)

    @property
    def saving(self) -> float | None:
        """FreeRide's cost saving, as a fraction of the training cost without FreeRide."""
        return cost_saving(
            side_value_s=self.side_value_s, k=self.k, training_s=self.training_s, vanilla_s=self.vanilla_s
        )

    def _total(self, what: str) -> int:
        return sum(int(getattr(s, what)) for s in self.stages)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["costs"] = [msgspec.structs.asdict(c) for c in self.costs]
        out["stages"] = [
            {
                **asdict(s),
                "bubble_share": s.bubble_share,
                "harvested_share": s.harvested_share,
                "interference_share": s.interference_share,
            }
            for s in self.stages
        ]
        out["tasks"] = [{**asdict(t), "cheap_gpu_s": t.cheap_gpu_s} for t in self.tasks]
        out.update(
            slowdown=self.slowdown,
            vanilla_s=self.vanilla_s,
            side_value_s=self.side_value_s,
            saving=self.saving,
            notes=list(self.notes),
        )
        return out

    def text(self) -> str:
        """The report as a table for a terminal."""
        lines = [
            f"{'stage':>5} {'device':10} {'steps':>6} {'bubble share':>12} {'bubble time':>11} {'harvested':>9}"
            f" {'interference':>12} {'of training':>11}"
        ]
        for s in self.stages:
            lines.append(
                f"{s.stage:>5} {s.device:10} {s.steps:>6} {_pct(s.bubble_share):>12} "
                f"{format_ns(s.bubble_ns):>11} {_pct(s.harvested_share):>9} {format_ns(s.interference_ns):>12}"
                f" {_pct(s.interference_share, 2):>11}"
            )
        step_ns, bubble_ns = self._total("step_ns"), self._total("bubble_ns")
        interference_ns = self._total("interference_ns")
        lines.append(
            f"{'all':>5} {'':10} {'':>6} {_pct(bubble_ns / step_ns if step_ns else None):>12} "
            f"{format_ns(bubble_ns):>11} {_pct(self._total('harvested_ns') / bubble_ns if bubble_ns else None):>9}"
            f" {format_ns(interference_ns):>12} {_pct(interference_ns / step_ns if step_ns else None, 2):>11}"
        )
        lines += ["", f"{'stage':>5} {'device':10} bubble time not harvested, by where it lies"]
        for s in self.stages:
            if s.bubble_ns:
                lines.append(
                    f"{s.stage:>5} {s.device:10} no side work {_pct(s.idle_ns / s.bubble_ns)}, before the first"
                    f" step {_pct(s.lead_ns / s.bubble_ns)}, after the last {_pct(s.tail_ns / s.bubble_ns)}"
                    f" ({_pct(s.tail_past_ns / s.bubble_ns)} past the predicted end),"
                    f" between grants {_pct(s.gap_ns / s.bubble_ns)}, inside grants between steps"
                    f" {_pct(s.between_steps_ns / s.bubble_ns)}"
                )
        lines += [
            "",
            f"{'task':>4} {'name':28} {'device':10} {'steps':>8} {'busy':>10} {'interference':>12}"
            f" {'alone':>10} {'cheap GPU':>10}",
        ]
        for t in self.tasks:
            alone = f"{t.throughput_alone:g}/s" if t.throughput_alone else "-"
            cheap = f"{t.cheap_gpu_s:.2f} s" if t.cheap_gpu_s is not None else "-"
            lines.append(
                f"{t.task_id:>4} {t.name[:28]:28} {t.device or '-':10} {t.work:>8} {format_ns(t.busy_ns):>10} "
                f"{format_ns(t.interference_ns):>12} {alone:>10} {cheap:>10}"
            )
        lines += [
            "",
            "harvested: side-task step time (wall) that lies inside the counted steps' bubbles. `freeride status`"
            " shows 'used', the side-task compute (CPU time) inside bubbles over the whole run: a task that waited"
            " for its core counts here but not there, so 'used' is the lower of the two.",
            "interference: side-task compute after bubble ends; a GPU does not preempt a running kernel, so on a GPU"
            " this time is taken from training. Its share is of the counted steps' time.",
            "not harvested: bubble time outside the grants' spans (first step start to last step end): in bubbles"
            " no work reached, before the first step (start latency), after the last (a deadline set before the"
            " bubble's real end, or a next step that did not fit; the part after the end the rank predicted, which"
            " deadlines are set by, in brackets), between grants, and inside the spans between steps (the worker's"
            " own work between two steps). With what was harvested they add up to the bubble time.",
            "",
        ]
        if self.median_step_ns is not None:
            line = f"training: {self.steps} steps, median {self.median_step_ns / 1e6:.2f} ms"
            if self.baseline_median_step_ns is not None and self.slowdown is not None:
                line += (
                    f" vs {self.baseline_median_step_ns / 1e6:.2f} ms baseline: slowdown {self.slowdown:+.2%}"
                    " (one run each, not an interval; for a slowdown with a confidence interval, use the"
                    " paired benchmarks in tools/bench/)"
                )
            lines.append(line)
        lines += [cost_line(c) + " (measured on the job's own steps, held back / harvested)" for c in self.costs]
        if self.saving is not None:
            prices = self.prices
            lines.append(
                f"cost: k = training GPU price x training GPUs / cheap GPU price = {prices.train_gpu_per_hour:g} $/h"
                f" x {self.train_gpus} / {prices.side_gpu_per_hour:g} $/h = {self.k:.3g} (--train-gpu-price,"
                " --train-gpus, --side-gpu-price; the defaults are the FreeRide paper's prices). Side work ="
                f" {self.side_value_s:.2f} s of cheap GPU = {self.side_value_s / self.k:.3f} s of training;"
                f" extra training time {self.training_s - self.vanilla_s:.3f} s of {self.vanilla_s:.2f} s"
            )
            one_run = ""
            if self.baseline_median_step_ns:
                one_run = " (from one run; as uncertain as the slowdown it includes)"
            lines.append(f"saving: {self.saving:.2%} of the training cost{one_run}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}%}"


def _unused(bubbles: list[Span], work: list[Span], expected: dict[int, int]) -> tuple[int, int, int, int, int]:
    """Where the bubble time that no work span covers lies: (no work at all, before the first, after the last,
    between two, the part of after the last past the predicted end), summed over ``bubbles`` (sorted,
    disjoint; ``work`` likewise; ``expected``: bubble start -> predicted length, where known)."""
    idle = lead = tail = gap = past = 0
    starts = [w[0] for w in work]
    for b0, b1 in bubbles:
        inside = _intersect([(b0, b1)], work[max(0, bisect.bisect_right(starts, b0) - 1) :])
        if not inside:
            idle += b1 - b0
            continue
        lead += inside[0][0] - b0
        tail += b1 - inside[-1][1]
        gap += inside[-1][1] - inside[0][0] - sum(end - start for start, end in inside)
        if b0 in expected:
            past += max(0, b1 - max(inside[-1][1], b0 + expected[b0]))
    return idle, lead, tail, gap, past


def _pipeline_steps(trace: Trace, warmup: int) -> dict[int, int]:
    """Counted step number -> its duration on the slowest stage."""
    durations: dict[int, int] = {}
    for timeline in trace.devices.values():
        for step, (start, end) in timeline.steps.items():
            durations[step] = max(durations.get(step, 0), end - start)
    kept = sorted(durations)[warmup:]
    return {s: durations[s] for s in kept}


def build_report(trace: Trace, options: ReportOptions, baseline: Trace | None = None) -> Report:
    """Compute a :class:`Report` from a FreeRide trace and, optionally, a baseline trace."""
    notes: list[str] = []
    counted = _pipeline_steps(trace, options.warmup_steps)
    stages: list[StageReport] = []
    windows: dict[str, Span | None] = {}
    regions: dict[str, list[Span]] = {}
    for timeline in sorted(trace.devices.values(), key=lambda t: (t.stage, t.device)):
        steps = _merge([span for s, span in timeline.steps.items() if s in counted])
        bubbles = _merge(timeline.bubbles)
        regions[timeline.device] = _intersect(bubbles, steps) if steps else bubbles
        windows[timeline.device] = (steps[0][0], steps[-1][1]) if steps else None
        if not steps:
            notes.append(f"{timeline.device}: no training steps in the trace; all its bubbles counted")
    harvested: dict[str, int] = dict.fromkeys(trace.devices, 0)
    starts = {device: [r[0] for r in region] for device, region in regions.items()}
    tasks: list[TaskReport] = []
    interfered: dict[str, int] = dict.fromkeys(trace.devices, 0)
    for task in sorted(trace.tasks.values(), key=lambda t: t.task_id):
        work = busy = taken = 0
        for start, end in task.interference:
            window = windows.get(task.device)
            if window is not None and not window[0] <= start < window[1]:
                continue
            taken += end - start
            if task.device in interfered:
                interfered[task.device] += end - start
        for g in task.grants:
            window = windows.get(g.device)
            if window is not None and not window[0] <= g.start_ns < window[1]:
                continue
            work, busy = work + g.steps, busy + g.busy_ns
            length = g.end_ns - g.start_ns
            if length > 0 and g.device in harvested:
                # busy time is spread over the grant's span; count the share that lies inside bubbles
                inside = _covered(regions[g.device], starts[g.device], (g.start_ns, g.end_ns))
                harvested[g.device] += round(g.busy_ns * inside / length)
        rate = next((r for pat, r in options.throughputs if fnmatch.fnmatchcase(task.name, pat)), None)
        if rate is None and work:
            notes.append(f"task {task.task_id} ({task.name}): no --side-throughput given; not in the saving")
        tasks.append(
            TaskReport(
                task_id=task.task_id,
                name=task.name,
                device=task.device,
                work=work,
                busy_ns=busy,
                throughput_alone=rate,
                interference_ns=taken,
            )
        )
    work_on: dict[str, list[Span]] = {}
    for task in trace.tasks.values():
        for g in task.grants:
            work_on.setdefault(g.device, []).append((g.start_ns, g.end_ns))
    for timeline in sorted(trace.devices.values(), key=lambda t: (t.stage, t.device)):
        steps = [span for s, span in timeline.steps.items() if s in counted]
        spans = _merge(work_on.get(timeline.device, []))
        idle, lead, tail, gap, past = _unused(regions[timeline.device], spans, timeline.expected)
        stages.append(
            StageReport(
                device=timeline.device,
                stage=timeline.stage,
                steps=len(steps),
                step_ns=sum(end - start for start, end in steps),
                bubble_ns=sum(end - start for start, end in regions[timeline.device]),
                harvested_ns=harvested[timeline.device],
                interference_ns=interfered[timeline.device],
                idle_ns=idle,
                lead_ns=lead,
                tail_ns=tail,
                tail_past_ns=past,
                gap_ns=gap,
            )
        )
    median = int(statistics.median(counted.values())) if counted else None
    base_median: int | None = None
    if baseline is not None:
        base_steps = _pipeline_steps(baseline, options.warmup_steps)
        if base_steps:
            base_median = int(statistics.median(base_steps.values()))
        else:
            notes.append("the baseline trace has no training steps; no slowdown measured")
    elif counted:
        notes.append("no baseline trace: the saving assumes no training slowdown")
    if not counted:
        notes.append("no training steps in the trace: no step time, no saving")
    train_gpus = options.prices.train_gpus or len(trace.devices)
    k = price_ratio(options.prices, train_gpus)
    return Report(
        stages=stages,
        tasks=tasks,
        steps=len(counted),
        median_step_ns=median,
        baseline_median_step_ns=base_median,
        training_s=sum(counted.values()) / 1e9,
        k=k,
        train_gpus=train_gpus,
        prices=options.prices,
        notes=tuple(notes),
        costs=tuple(trace.costs.values()),
    )
