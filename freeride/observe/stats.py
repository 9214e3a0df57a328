"""Small running statistics kept by the manager."""

from __future__ import annotations

from collections import deque

__all__ = ["LatencyRecorder", "quantile"]


def quantile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank quantile of an already sorted list (0 if empty)."""
    if not sorted_values:
        return 0
    rank = max(0, min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1))))
    return sorted_values[rank]


class LatencyRecorder:
    """Keeps the most recent ``capacity`` latencies (ns) and summarises them.

    The summary sorts the values kept, on the manager's loop: the window is
    kept small enough for that to take a few ms (20k values), and a summary is
    reused until a new value arrives.
    """

    def __init__(self, capacity: int = 20_000) -> None:
        self._values: deque[int] = deque(maxlen=capacity)
        self.count = 0
        self._summary: tuple[int, tuple[int, int, int]] = (0, (0, 0, 0))

    def record(self, value_ns: int) -> None:
        self._values.append(value_ns)
        self.count += 1

    def values(self) -> list[int]:
        return list(self._values)

    def summary(self) -> tuple[int, int, int]:
        """``(p50, p99, max)`` over the values kept."""
        seen, cached = self._summary
        if seen == self.count:
            return cached
        values = sorted(self._values)
        summary = quantile(values, 0.50), quantile(values, 0.99), (values[-1] if values else 0)
        self._summary = (self.count, summary)
        return summary
