"""What a report is asked for: prices, side-task throughputs alone and warm-up steps, from the command line."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from freeride.observe.report.saving import Prices

__all__ = ["ReportOptions", "parse_throughputs"]


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
