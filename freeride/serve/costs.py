"""The training jobs' measured costs, and what the device schedulers may grant because of them.

One :class:`_Job` per training job this manager hears from (by the ``job`` of
its ranks' Hello): its held-back steps (:mod:`freeride.holdback`), its
cost meter (:mod:`freeride.serve.meter`) and its slowdown budget
(:mod:`freeride.serve.budget`). A device's scheduler asks :meth:`TrainingCosts.withheld`
before it grants a bubble; the manager hands every finished step to
:meth:`TrainingCosts.step_finished`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from freeride import protocol as p
from freeride.holdback import HoldbackSchedule, granted
from freeride.observe.stats import median_interval
from freeride.serve.budget import SlowdownBudget
from freeride.serve.meter import CostMeter
from freeride.serve.ranks import MAX_RANKS

__all__ = ["MAX_JOBS", "TrainingCosts", "Withheld"]

logger = logging.getLogger(__name__)

MAX_JOBS = 16
"""Jobs one manager keeps figures of (one node trains one or a few jobs at once; a job not heard of for
longest makes room for a new one, so a hostile sender cannot make the manager hold more)."""

Withheld = Literal["", "held_back", "backed_off"]
"""Why a bubble gets no side work: held back to measure the job's cost, or left out for its budget."""


@dataclass(slots=True)
class _Job:
    schedule: HoldbackSchedule
    meter: CostMeter
    budget: SlowdownBudget | None
    period: int = 0
    """Changes of the harvest level so far: a level is judged only on the pairs measured since it was set."""

    @property
    def share(self) -> float:
        return self.budget.share if self.budget is not None else 1.0


class TrainingCosts:
    """Every job's holdback, meter and budget (see the module's docstring).

    Args:
        holdback: Which steps are held back (``every=0``: none, and no cost is measured).
        budget: The slowdown a job may pay, as a share (0: no budget, harvesting never backs off).
        on_pair: Told of a job's cost each time a pair of blocks is measured.
    """

    def __init__(
        self,
        holdback: p.Holdback,
        *,
        budget: float = 0.0,
        on_pair: Callable[[p.TrainingCost], None] | None = None,
    ) -> None:
        self._holdback = holdback
        self.budget = budget
        self._on_pair = on_pair
        self._jobs: dict[str, _Job] = {}
        self._rank_job: dict[int, str] = {}

    def _job(self, name: str) -> _Job:
        job = self._jobs.get(name)
        if job is None:
            if len(self._jobs) >= MAX_JOBS:  # the job heard of least recently makes room
                del self._jobs[next(iter(self._jobs))]
            schedule = HoldbackSchedule(msgspec.structs.replace(self._holdback, job=name))
            budget = SlowdownBudget(self.budget) if self.budget > 0 and self._holdback.enabled else None
            job = self._jobs[name] = _Job(schedule, CostMeter(schedule), budget)
        return job

    def hello(self, rank: int, job: str) -> None:
        """Rank ``rank`` trains in ``job``.

        A rank not heard of yet is taken to train in the one job of the ranks heard of, else in job "".
        """
        self._rank_job.pop(rank, None)
        self._rank_job[rank] = job
        if len(self._rank_job) > MAX_RANKS:  # the oldest first, as the ranks table makes room
            self._rank_job.pop(next(iter(self._rank_job)))

    def meter(self, job: str) -> CostMeter | None:
        """The meter of ``job`` (``None`` if no rank of it reported)."""
        known = self._jobs.get(job)
        return known.meter if known is not None else None

    def _of(self, rank: int) -> _Job:
        name = self._rank_job.get(rank)
        if name is None:
            # a rank whose Hello is not in yet (or a device before its first bubble): where the ranks
            # heard of all train in one job, as on most nodes, it is that one
            named = set(self._rank_job.values())
            name = named.pop() if len(named) == 1 else ""
        return self._job(name)

    def withheld(self, rank: int, step: int, index: int) -> Withheld:
        """Why bubble ``index`` of ``rank``'s step ``step`` gets no side work ("" if it may get some)."""
        job = self._of(rank)
        if job.schedule.held(step):
            return "held_back"
        if not granted(job.share, step, index):
            return "backed_off"
        return ""

    def harvest_share(self, rank: int) -> float:
        """The share of ``rank``'s job's bubbles granted now (1.0 unless its budget backs harvesting off).

        An armed worker carries it and leaves out the bubbles :meth:`withheld` calls ``backed_off``.
        """
        return self._of(rank).share

    def holdback(self, rank: int) -> p.Holdback | None:
        """The held-back steps of ``rank``'s job, for an armed worker to leave alone (``None``: none)."""
        return self._of(rank).schedule.config if self._holdback.enabled else None

    def step_finished(self, rank: int, step: int, duration_ns: int) -> None:
        if not self._holdback.enabled:
            return
        job = self._of(rank)
        name = job.schedule.job
        if next(reversed(self._jobs)) != name:  # the most recently heard of last (see _job)
            self._jobs[name] = self._jobs.pop(name)
        if job.meter.step_finished(rank, step, duration_ns, period=job.period) is None:
            return
        budget = job.budget
        if budget is not None:
            level = budget.level
            if budget.update(job.meter.estimate(job.period)):
                job.period += 1
                log = logger.warning if budget.level > level else logger.info
                log("[budget] job %r: %s", job.schedule.job, budget.reason or "every bubble granted again")
        if self._on_pair is not None:
            self._on_pair(self._status(job))

    def _status(self, job: _Job) -> p.TrainingCost:
        meter = job.meter
        recent = meter.differences(job.period)
        base = p.TrainingCost(
            job=job.schedule.job,
            steps=meter.steps,
            pairs=0,
            held_share=job.schedule.held_share(meter.steps),
            harvest_share=job.share,
            budget=job.budget.budget if job.budget is not None else 0.0,
            reason=job.budget.reason if job.budget is not None else "",
            confidence=meter.confidence,
        )
        if not recent:
            return base
        est = median_interval(recent, confidence=meter.confidence)
        return msgspec.structs.replace(
            base, pairs=est.n, slowdown=est.median, low=est.low, high=est.high, coverage=est.coverage, recent=recent
        )

    def status(self) -> list[p.TrainingCost]:
        """Each job's cost, for jobs that have run steps."""
        if not self._holdback.enabled:
            return []
        return [self._status(job) for job in self._jobs.values() if job.meter.steps > 0]
