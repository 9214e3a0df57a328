"""Clocks: the monotonic clock everything runs on, and a manual one for tests.

Code that decides by time (the worker's gate, the device scheduler) takes a
:class:`Clock` instead of calling :func:`time.monotonic_ns`, so that tests can
drive it step by step, as trio's ``MockClock`` allows.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["MONOTONIC", "Clock", "ManualClock", "MonotonicClock"]


class Clock(Protocol):
    def now_ns(self) -> int:
        """Nanoseconds on a monotonic scale (the one event timestamps use)."""
        ...


class MonotonicClock:
    """:func:`time.monotonic_ns`, the clock of every timestamp on the wire."""

    __slots__ = ()

    def now_ns(self) -> int:
        return time.monotonic_ns()


MONOTONIC: Clock = MonotonicClock()


class ManualClock:
    """A clock that moves only when told to (tests)."""

    __slots__ = ("_t",)

    def __init__(self, start_ns: int = 1_000_000_000) -> None:
        self._t = start_ns

    def now_ns(self) -> int:
        return self._t

    def advance(self, ns: int) -> None:
        if ns < 0:
            raise ValueError(f"a monotonic clock cannot go back ({ns} ns)")
        self._t += ns

    def set(self, t_ns: int) -> None:
        self.advance(t_ns - self._t)
