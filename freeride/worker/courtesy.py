"""Let the rank block before a bubble's first side step takes its core.

A rank announces its bubble and then blocks on its receive. The announcement
wakes the side worker on the rank's own core, and the kernel may run the worker
at once, before the rank has reached its blocking call: the rank then waits,
runnable, for a scheduler slice (2-5 ms seen here) while nothing of training
is lost, since it had only to block. But the rank reads that wait in its run
delay counter (:mod:`freeride.host.schedstat`) as if it were the stage waiting for
its core at the bubble's end: the manager charged it as interference (in the
GPU-faithful mode) and the simulated stages took it off the bubble's measured
length, so the next predictions came out short. In a demo run, 77 ms of such
waits against 42 ms of real ones at the bubbles' ends.

So, before the first step of a grant, a worker pinned to one core yields that
core while the rank's announcing thread (``BubbleStarted.thread``) is runnable
on it, for at most a bound. Where the worker is not pinned to one core, or the
thread is on another core, there is nothing to do. Linux only (``/proc``); a
no-op elsewhere or where the thread cannot be read.

It yields first with ``sched_yield``, then by sleeping: at the stage's own
priority ``sched_yield`` hands the core back to the worker itself whenever the
rank, which has just computed, is not yet owed CPU time under the kernel's
fair scheduler (EEVDF's eligibility): in a DeepSpeed CPU job 115 of 184 such
waits ran to a 2 ms bound, the rank runnable throughout. Sleeping gives the
rank the core for certain; it then needed 0.4-1.1 ms (p10-p90) to block,
DeepSpeed's own work between its hook and its receive.
"""

from __future__ import annotations

import os
import time
from typing import Protocol

__all__ = ["Courtesy", "RankCourtesy"]

_YIELD_BOUND_NS = 2_000_000
"""Longest a worker defers to its rank: longer, and the rank is busy with something else than blocking."""

_NAP_S = 50e-6
"""One sleep while the rank is still runnable (about 0.1 ms with the kernel's timer slack)."""


def _state_and_cpu(stat: bytes) -> tuple[bytes, int]:
    """A ``/proc/<tid>/stat`` line's state letter and last CPU (fields 3 and 39)."""
    rest = stat[stat.rindex(b")") + 2 :].split()  # the thread's name may hold spaces and parentheses
    return rest[0], int(rest[36])


class Courtesy(Protocol):
    """What the gate asks before a grant's first step (a :class:`RankCourtesy`, or a test's fake)."""

    def follow(self, tid: int) -> None: ...

    def defer(self) -> int: ...

    def close(self) -> None: ...


class RankCourtesy:
    """Yields the worker's core to its rank's thread while that thread is runnable on it."""

    def __init__(self, *, bound_ns: int = _YIELD_BOUND_NS) -> None:
        self._bound_ns = bound_ns
        self._tid = 0
        self._fd = -1
        self._core = -1

    @staticmethod
    def _own_core() -> int:
        """The one core this process may run on, else -1 (nothing to yield to)."""
        try:
            cores = os.sched_getaffinity(0)
        except (AttributeError, OSError):
            return -1
        return next(iter(cores)) if len(cores) == 1 else -1

    def follow(self, tid: int) -> None:
        """The rank's announcing thread is ``tid`` (0: unknown)."""
        if tid == self._tid:
            return
        self.close()
        self._tid = tid
        self._core = self._own_core()  # read here: a worker may be pinned after it was built
        if tid > 0 and self._core >= 0:
            try:
                self._fd = os.open(f"/proc/{tid}/stat", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._fd = -1

    def waiting(self) -> bool:
        """Whether the rank's thread is runnable on this worker's core (so it waits for it)."""
        if self._fd < 0:
            return False
        try:
            state, cpu = _state_and_cpu(os.pread(self._fd, 1024, 0))
        except (OSError, ValueError, IndexError):
            self.close()  # the thread is gone
            return False
        return state == b"R" and cpu == self._core

    def defer(self) -> int:
        """Yield while the rank waits for this core, up to the bound; ns spent (0 if it did not wait)."""
        if not self.waiting():
            return 0
        t0 = time.monotonic_ns()
        os.sched_yield()  # enough where the rank is owed the core (a worker at a lower priority)
        while True:
            spent = time.monotonic_ns() - t0
            if spent >= self._bound_ns or not self.waiting():
                return spent
            time.sleep(_NAP_S)

    def close(self) -> None:
        """Release the thread's file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1
        self._tid = 0
