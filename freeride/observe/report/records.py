"""The report's records (per stage, per side task, for the job), as a dict and as a table for a terminal."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from freeride import protocol as p
from freeride.observe.cost import cost_line
from freeride.observe.report.saving import Prices, cost_saving
from freeride.units import format_ns

__all__ = ["Report", "StageReport", "TaskReport"]


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
