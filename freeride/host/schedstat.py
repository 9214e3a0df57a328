"""How long a thread waited for its core while runnable (Linux schedstat), for both sides of a bubble.

The rank's side: on a core a stage shares with side tasks at its own priority (the GPU-faithful
CPU mode), a bubble's end comes when the stage's receive completes; if a side
step holds the core then, the stage stays runnable, not running, until the
kernel lets the step go. The stage stamps its bubble's end only once it runs
again, so that wait would count as bubble time. Linux keeps, per thread, the
total time it waited runnable (``/proc/thread-self/schedstat``, field 2): read
at a bubble's start and end, the difference is that wait (a blocked thread
accrues none). The manager counts it as interference. That holds only if the
stage did not also wait between its announcement and its blocking receive: the
side worker the announcement wakes lets it block first
(:mod:`freeride.worker.courtesy`).

The side task's: a worker at the lowest priority on its stage's core waits
whenever the stage wakes up mid-step. That wait says nothing about what the
step costs, so the gate takes it out of the step times its estimates learn from
(never out of the time reported as used).

Cheap and silent: one ``pread`` of an open file per reading, nothing raised;
0 where the file cannot be read (not Linux, schedstats off) or when called
from a thread other than the one that opened it.
"""

from __future__ import annotations

import os
import threading
from typing import Protocol

__all__ = ["RunDelay", "ThreadRunDelay"]

_SCHEDSTAT = "/proc/thread-self/schedstat"


class RunDelay(Protocol):
    """How long this thread has waited for a CPU while runnable, in ns (a counter)."""

    def ns(self) -> int:
        """The counter's current value (0 where it cannot be read)."""
        ...

    def close(self) -> None:
        """Release what the counter holds; later reads return 0."""
        ...


class ThreadRunDelay:
    """The calling thread's run delay counter (ns), opened on first use by the thread that reads it."""

    def __init__(self, path: str = _SCHEDSTAT) -> None:
        self._path = path
        self._fd = -1
        self._thread: int | None = None
        """The thread the counter belongs to (None: not opened yet)."""

    def ns(self) -> int:
        """The counter's current value; 0 where it cannot be read (the caller then measures no wait)."""
        if self._thread is None:
            self._thread = threading.get_ident()
            try:
                self._fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._fd = -1
        if self._fd < 0 or threading.get_ident() != self._thread:
            return 0
        try:
            return int(os.pread(self._fd, 64, 0).split()[1])
        except (OSError, ValueError, IndexError):
            return 0

    def close(self) -> None:
        """Release the file (idempotent); later reads return 0."""
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1
        self._thread = self._thread or 0
