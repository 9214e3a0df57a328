"""The training job's measured cost, in words: one text for ``status``, ``report`` and ``demo``."""

from __future__ import annotations

from freeride import protocol as p
from freeride.observe.stats import pairs_needed
from freeride.serve.budget import JUDGE_PAIRS

__all__ = ["cost_line", "cost_lines", "percent"]


def percent(share: float, *, signed: bool = True) -> str:
    """``0.0021`` as ``+0.21 %``."""
    return f"{share * 100:{'+' if signed else ''}.2f} %"


def cost_line(cost: p.TrainingCost) -> str:
    """``training cost +0.21 % (95 %: -0.10 .. +0.48 %, 812 steps)``, or what it still waits for."""
    job = f" of job {cost.job}" if cost.job else ""
    if cost.pairs == 0:
        return f"training cost{job}: measuring ({cost.steps} steps, no held-back pair complete yet)"
    level = f"{cost.confidence:.0%}".replace("%", " %")
    interval = f"{percent(cost.low)[:-2]} .. {percent(cost.high)}"
    if cost.coverage < cost.confidence:
        need = pairs_needed(cost.confidence)
        return (
            f"training cost{job} {percent(cost.slowdown)} (measuring: {cost.pairs} of the {need} pairs a {level}"
            f" interval needs; {interval} covers {cost.coverage * 100:.1f} %; {cost.steps} steps)"
        )
    return f"training cost{job} {percent(cost.slowdown)} ({level}: {interval}, {cost.steps} steps, {cost.pairs} pairs)"


def cost_lines(costs: list[p.TrainingCost], devices: list[p.DeviceStatus]) -> list[str]:
    """Each job's cost line, what measuring it takes from the harvest, and why harvesting is backed off."""
    if not costs:
        return []
    lines = [cost_line(c) for c in costs]
    bubble = sum(d.bubble_ns for d in devices)
    held = sum(d.held_back_ns for d in devices)
    backed = sum(d.backed_off_ns for d in devices)
    if bubble:
        share = max(c.held_share for c in costs)
        lines.append(
            f"  measuring it: {held / bubble * 100:.1f} % of the bubble time held back so far"
            f" (one step in {round(1 / share) if share else 0} now)"
        )
    for c in costs:
        if c.harvest_share < 1.0:
            taken = f" ({backed / bubble * 100:.1f} % of the bubble time so far)" if bubble else ""
            lines.append(f"  slowdown budget {percent(c.budget, signed=False)}: {c.reason}{taken}")
        elif c.budget:
            judged = (
                f"; an upper bound above it is acted on from {JUDGE_PAIRS} pairs on"
                if c.pairs < JUDGE_PAIRS and c.high > c.budget
                else ""
            )
            lines.append(f"  slowdown budget {percent(c.budget, signed=False)}: every bubble granted{judged}")
    return lines
