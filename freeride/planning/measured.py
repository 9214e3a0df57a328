"""Measured bubble use and interference that ``freeride plan`` multiplies its modelled bubbles by.

The planner models how much bubble a job has (:mod:`freeride.backends.schedule`); how
much of that bubble a side task really fills, and what it takes from training,
it does not model: it takes them from the measured runs listed here, each
with where and when it was measured. They are copies of rows of
``docs/benchmarks.md`` ("Bubble use of every workload"): when a benchmark is
rerun there, update its row here in the same change.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MEASURED", "MeasuredUse", "measured_for"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredUse:
    """One measured run: a side task in the bubbles of a real (small) pipeline job."""

    task: str
    """Catalog name of the side task (``freeride submit --list``)."""
    use: float
    """Share of the bubble time the side task's steps filled."""
    interference: float | None
    """Side-task compute past bubble ends, as a share of the time trained (None: not measured)."""
    job: str
    """The job it ran in."""
    steps: int
    """Training steps of the run."""
    source: str
    """Where the row is documented, with the date of the run."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.use <= 1.0:
            raise ValueError(f"use must be a share in [0, 1], got {self.use}")
        if self.interference is not None and not 0.0 <= self.interference <= 1.0:
            raise ValueError(f"interference must be a share in [0, 1], got {self.interference}")


_DS_JOB = "DeepSpeed CPU job, 2 stages, m=4, ~0.29 s steps, side tasks at the stage's priority"
_DS_SOURCE = "docs/benchmarks.md, 'Bubble use of every workload', 2026-11-27 15:06-15:31"

MEASURED: tuple[MeasuredUse, ...] = (
    # the 200-step rows: the guard has settled, which a long job sees too
    MeasuredUse(task="graph-sgd", use=0.741, interference=0.0029, job=_DS_JOB, steps=200, source=_DS_SOURCE),
    MeasuredUse(task="pagerank", use=0.707, interference=0.0012, job=_DS_JOB, steps=200, source=_DS_SOURCE),
    MeasuredUse(task="imaging", use=0.709, interference=0.0020, job=_DS_JOB, steps=200, source=_DS_SOURCE),
    MeasuredUse(task="resnet18-train", use=0.717, interference=0.0013, job=_DS_JOB, steps=200, source=_DS_SOURCE),
    MeasuredUse(task="resnet50-train", use=0.697, interference=0.0018, job=_DS_JOB, steps=200, source=_DS_SOURCE),
    MeasuredUse(task="vgg19-train", use=0.706, interference=0.0018, job=_DS_JOB, steps=200, source=_DS_SOURCE),
)
"""Per side task, its measured bubble use in the DeepSpeed CPU job (the 200-step run)."""

DEMO = MeasuredUse(
    task="graph-sgd",
    use=0.847,
    interference=None,
    job="freeride demo: simulated 2-stage 1F1B (sleep), m=4, 10/20 ms, side tasks at nice 19",
    steps=40,
    source="docs/benchmarks.md, 'Bubble use of every workload' (the demo: 80-86 % in twelve runs), 2026-11-27",
)
"""The demo's measured use (the median of its twelve runs); its interference was not given."""


def measured_for(task: str) -> MeasuredUse | None:
    """The measured row of ``task`` (a catalog name), if it has one."""
    return next((row for row in MEASURED if row.task == task), None)
