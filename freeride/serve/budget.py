"""The slowdown budget: harvesting backs off while the job's measured cost may exceed it.

The interference guard (:mod:`freeride.serve.guard`) is the fast inner loop: it
keeps side work inside bubbles, bubble by bubble, by the clocks. This is the
outer loop, on the outcome: the job's step times
(:class:`~freeride.serve.meter.CostMeter`). When the measured cost's interval
lies above the budget (at once), or its upper end still passes the budget once
enough pairs are in to judge, the share of bubbles granted steps down (all,
three quarters, half, a quarter, none); once the interval at a lower level
lies well inside the budget, it steps back up. Each level is judged only on
pairs measured at that level. Few pairs give a wide interval whatever the
cost (six give the range of all six): acting on its upper end alone before
:attr:`SlowdownBudget.judge_pairs` would back off on noise.

The bubbles a level leaves out are picked by a fixed rule of the step and the
bubble's index (:func:`freeride.holdback.granted`), so that every device of a
job, and every worker armed on one, leaves out the same ones.
"""

from __future__ import annotations

from freeride.observe.stats import MedianInterval

__all__ = ["JUDGE_PAIRS", "LEVELS", "SlowdownBudget"]

JUDGE_PAIRS = 16
"""Pairs measured at a level before the upper end of its interval alone may step it down, or it may step up."""

LEVELS = (1.0, 0.75, 0.5, 0.25, 0.0)
"""The share of bubbles granted at each level (0: all, the default)."""


class SlowdownBudget:
    """Chooses the harvest level from the measured cost.

    Args:
        budget: The slowdown the job may pay, as a share (0.005: 0.5 %).
        min_coverage: An interval must guarantee this coverage before it is acted on.
        judge_pairs: Pairs measured at a level before its upper end alone may step it down,
            or a level may step back up.
    """

    def __init__(self, budget: float, *, min_coverage: float = 0.95, judge_pairs: int = JUDGE_PAIRS) -> None:
        if not 0 < budget < 1:
            raise ValueError(f"budget must be in (0, 1), got {budget}")
        self.budget = budget
        self.min_coverage = min_coverage
        self.judge_pairs = judge_pairs
        self.level = 0
        self.reason = ""
        """Why harvesting is backed off ("" at full harvest)."""

    @property
    def share(self) -> float:
        """The share of bubbles granted now."""
        return LEVELS[self.level]

    def update(self, at_level: MedianInterval | None) -> bool:
        """Judge the estimate over the current level's pairs; whether the level changed."""
        if at_level is None or at_level.coverage < self.min_coverage:
            return False
        over = at_level.low > self.budget or (at_level.n >= self.judge_pairs and at_level.high > self.budget)
        if over and self.level < len(LEVELS) - 1:
            self.level += 1
            bound = at_level.low if at_level.low > self.budget else at_level.high
            which = "lower" if bound == at_level.low else "upper"
            self.reason = (
                f"the measured cost's {which} bound {bound:+.2%} > the {self.budget:.2%} budget:"
                f" {LEVELS[self.level]:.0%} of bubbles granted"
            )
            return True
        if self.level > 0 and at_level.n >= self.judge_pairs and at_level.high <= self.budget / 2:
            self.level -= 1
            self.reason = (
                ""
                if self.level == 0
                else (
                    f"backed off for the {self.budget:.2%} budget: {LEVELS[self.level]:.0%} of bubbles granted"
                    f" (with {LEVELS[self.level + 1]:.0%} the bound was {at_level.high:+.2%})"
                )
            )
            return True
        return False
