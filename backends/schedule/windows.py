"""Bubble finding: the idle windows of each rank read off a simulated timeline, and their dumps."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from freeride.backends.schedule.simulator import Timeline
from freeride.backends.schedule.values import Action

__all__ = ["BubbleWindow", "bubble_fraction", "bubbles", "bubbles_to_text"]

# Gaps shorter than this share of the step are float noise from adding durations, not bubbles.
_REL_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class BubbleWindow:
    """An idle window of one rank within a step.

    Attributes:
        stage: Pipeline rank.
        index: Position among this rank's kept windows of the step, in time order.
        start: Seconds from step start.
        duration: Seconds.
        before: The action that ends the bubble; ``None`` for the tail bubble.
    """

    stage: int
    index: int
    start: float
    duration: float
    before: Action | None

    @property
    def end(self) -> float:
        """Seconds from step start at which the bubble ends."""
        return self.start + self.duration


def bubbles(timeline: Timeline, *, min_duration: float = 0.0) -> tuple[tuple[BubbleWindow, ...], ...]:
    """Per rank, the idle windows between step start (0) and the makespan.

    The head (0 to the first action) and the tail (last action to the makespan) count.
    Windows of ``min_duration`` or less are dropped; so are gaps within float noise
    (``1e-9`` of the makespan). Indices stay dense over the kept windows.
    """
    threshold = max(min_duration, _REL_EPS * timeline.makespan)
    result: list[tuple[BubbleWindow, ...]] = []
    for rank, row in enumerate(timeline.per_rank):
        windows: list[BubbleWindow] = []
        edges: Iterable[tuple[float, float, Action | None]] = zip(
            [0.0, *(t.end for t in row)],
            [*(t.start for t in row), timeline.makespan],
            [*(t.action for t in row), None],
            strict=True,
        )
        for start, end, before in edges:
            if end - start > threshold:
                windows.append(BubbleWindow(rank, len(windows), start, end - start, before))
        result.append(tuple(windows))
    return tuple(result)


def bubble_fraction(timeline: Timeline, stage: int | None = None) -> float:
    """Idle share of the step for ``stage``, or the mean over ranks when ``stage`` is None.

    Raises:
        ValueError: ``stage`` is out of range.
    """
    p = len(timeline.per_rank)
    if stage is not None and not 0 <= stage < p:
        raise ValueError(f"stage must be in 0..{p - 1}, got {stage}")
    if timeline.makespan <= 0:
        return 0.0
    ranks = range(p) if stage is None else (stage,)
    idle = [timeline.makespan - sum(t.end - t.start for t in timeline.per_rank[r]) for r in ranks]
    return sum(idle) / (len(idle) * timeline.makespan)


def bubbles_to_text(windows: tuple[tuple[BubbleWindow, ...], ...]) -> str:
    """A stable, readable dump of :func:`bubbles`: one line per window (used by golden files)."""
    lines = ["# stage index start duration before"]
    for w in (window for row in windows for window in row):
        before = "-" if w.before is None else str(w.before)
        lines.append(f"{w.stage} {w.index} {w.start:.6f} {w.duration:.6f} {before}")
    return "\n".join(lines) + "\n"
