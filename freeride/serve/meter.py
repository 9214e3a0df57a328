"""What side work costs a training job, measured on the job's own step times.

Each cycle of the job's :class:`~freeride.holdback.HoldbackSchedule` has
a pair of adjacent blocks of steps, one held back (no side work) and one
harvested. When both have run, the pair gives one figure: the harvested
block's mean step time over the held block's, minus one, over the ranks that
reported steps in both (each rank's mean first, then their mean). The job's
cost is the median of these figures, with the order-statistic interval of
:func:`~freeride.observe.stats.median_interval`: with the fair coin of each pair,
that interval holds its coverage whatever the step times' drift and
dependence, for a cost that is the same in every pair.

The meter covers what side work costs while it runs: compute past a bubble's
end, wake-ups, contention for caches and memory. What FreeRide costs a job
whether or not side work runs (its hooks, an idle manager) is the same in both
blocks of a pair and is measured by the paired benchmarks instead.

Pure: the manager feeds it every ``StepFinished`` of the job's ranks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from freeride.holdback import HoldbackSchedule
from freeride.observe.stats import MedianInterval, median_interval
from freeride.serve.ranks import MAX_RANKS

__all__ = ["MAX_PENDING", "WINDOW", "CostMeter"]

WINDOW = 256
"""Pairs an estimate is taken over: the latest, of the harvest period in force."""
MAX_PENDING = 8
"""Cycles whose pair is still being measured (a sender jumping steps cannot make the meter hold more)."""


@dataclass(slots=True)
class _Sums:
    total_ns: int = 0
    count: int = 0

    def add(self, ns: int) -> None:
        self.total_ns += ns
        self.count += 1


@dataclass(slots=True)
class _Pending:
    pair_end: int
    period: int = -1
    """The harvest period when the harvested block's first measured step came in (-1: none yet)."""
    held: dict[int, _Sums] = field(default_factory=dict)
    harvested: dict[int, _Sums] = field(default_factory=dict)


def _difference(pending: _Pending) -> float | None:
    """The pair's harvested / held - 1 over the ranks measured in both blocks, or ``None`` if none was."""
    ranks = [r for r in pending.held if r in pending.harvested]
    if not ranks:
        return None
    held = sum(pending.held[r].total_ns / pending.held[r].count for r in ranks) / len(ranks)
    harvested = sum(pending.harvested[r].total_ns / pending.harvested[r].count for r in ranks) / len(ranks)
    return harvested / held - 1 if held > 0 else None


class CostMeter:
    """One job's training cost (see the module's docstring).

    Args:
        schedule: The job's held-back steps.
        confidence: Of the interval reported.
    """

    def __init__(self, schedule: HoldbackSchedule, *, confidence: float = 0.95) -> None:
        self.schedule = schedule
        self.confidence = confidence
        self._pending: dict[int, _Pending] = {}
        self._last_cycle = -1
        """The latest cycle whose pair was closed: a step of it or of an earlier one comes too late."""
        self._rank_step: dict[int, int] = {}
        """The last step each rank reported: one going back means the job started over."""
        self._pairs: deque[tuple[float, int]] = deque(maxlen=4 * WINDOW)
        """(difference, harvest period) of each finished pair, oldest first."""
        self.steps = 0
        """Training steps the job has run: the highest step reported, plus one (summed over restarts)."""
        self._steps_before = 0
        self.measured_steps = 0
        """Steps that went into a pair."""
        self.pairs = 0
        """Pairs measured in all."""

    def step_finished(self, rank: int, step: int, duration_ns: int, *, period: int = 0) -> float | None:
        """Take one rank's step; the difference of the pair this step completes, if it completes one.

        ``period`` numbers the stretch of steps harvested alike (the slowdown budget starts a
        new one each time it changes how much is harvested); an estimate is taken over one.
        """
        if step < self._rank_step.get(rank, -1):
            # the job started over (a restart counts steps from 0 again): its old pairs stay, the
            # unfinished one goes
            self._pending.clear()
            self._last_cycle = -1
            self._rank_step.clear()
            self._steps_before = self.steps
        self._rank_step[rank] = step
        if len(self._rank_step) > MAX_RANKS:
            self._rank_step.pop(next(iter(self._rank_step)))
        self.steps = max(self.steps, self._steps_before + step + 1)
        slot = self.schedule.slot(step)
        if slot is None or duration_ns <= 0 or slot.cycle <= self._last_cycle:
            return None
        done = self._finish_before(step)
        if slot.role is None or not slot.measured:
            return done
        pending = self._pending.get(slot.cycle)
        if pending is None:
            if len(self._pending) >= MAX_PENDING:
                self._pending.pop(min(self._pending))
            pending = self._pending[slot.cycle] = _Pending(pair_end=slot.pair_end)
        if slot.role == "held":
            pending.held.setdefault(rank, _Sums()).add(duration_ns)
        else:
            if pending.period < 0:
                pending.period = period
            pending.harvested.setdefault(rank, _Sums()).add(duration_ns)
        self.measured_steps += 1
        return done

    def _finish_before(self, step: int) -> float | None:
        """Close the pairs that ended before ``step``.

        A rank reports a step only once every rank of a pipeline has ended the one before.
        """
        last: float | None = None
        for cycle in sorted(c for c, pend in self._pending.items() if pend.pair_end <= step):
            pending = self._pending.pop(cycle)
            self._last_cycle = max(self._last_cycle, cycle)
            difference = _difference(pending)
            if difference is not None:
                self._pairs.append((difference, max(0, pending.period)))
                self.pairs += 1
                last = difference
        return last

    def differences(self, period: int | None = None) -> list[float]:
        """The latest :data:`WINDOW` pairs' differences (of ``period`` only, if given), oldest first."""
        picked = [d for d, at in self._pairs if period is None or at == period]
        return picked[-WINDOW:]

    def estimate(self, period: int | None = None) -> MedianInterval | None:
        """The cost's median and interval over :meth:`differences`; ``None`` before the first pair."""
        values = self.differences(period)
        return median_interval(values, confidence=self.confidence) if values else None
