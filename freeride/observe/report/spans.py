"""Interval arithmetic on time spans (``(start_ns, end_ns)`` pairs): merge, intersect, measure overlap."""

from __future__ import annotations

import bisect

from freeride.observe.timeline import Span

__all__ = ["covered", "intersect", "merge"]


def merge(spans: list[Span]) -> list[Span]:
    """The union of ``spans`` as sorted, disjoint spans (touching spans join; empty ones are dropped)."""
    out: list[Span] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def intersect(a: list[Span], b: list[Span]) -> list[Span]:
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


def covered(region: list[Span], starts: list[int], span: Span) -> int:
    """Length of ``span`` inside ``region`` (sorted, disjoint; ``starts`` its start points)."""
    total = 0
    k = max(0, bisect.bisect_right(starts, span[0]) - 1)
    while k < len(region) and region[k][0] < span[1]:
        total += max(0, min(region[k][1], span[1]) - max(region[k][0], span[0]))
        k += 1
    return total
