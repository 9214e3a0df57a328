"""The one rule that decides whether side work may start: it must end by the deadline minus the margin.

A grant carries the bubble's expected end (its deadline); the safety margin
absorbs the time between deciding and starting. The manager's scheduler (whom
to grant a bubble), the worker's gate (whether the next step may start) and the
imperative runner (when to stop a program) all ask these functions, so the
three can never disagree.
"""

from __future__ import annotations

__all__ = ["fits", "latest_end_ns", "room_ns"]


def latest_end_ns(deadline_ns: int, margin_ns: int) -> int:
    """When side work must have ended (an imperative program is stopped then)."""
    return deadline_ns - margin_ns


def room_ns(now_ns: int, deadline_ns: int, margin_ns: int) -> int:
    """How long a step starting at ``now_ns`` may take (negative: none fits)."""
    return latest_end_ns(deadline_ns, margin_ns) - now_ns


def fits(now_ns: int, need_ns: int, deadline_ns: int, margin_ns: int) -> bool:
    """Whether work of ``need_ns`` (>= 0) started at ``now_ns`` ends in time."""
    return need_ns <= room_ns(now_ns, deadline_ns, margin_ns)
