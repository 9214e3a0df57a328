"""A process's CPU placement and priority, applied to every thread it has (Linux).

``os.sched_setaffinity(0, ...)`` and ``os.setpriority(PRIO_PROCESS, 0, ...)``
change the calling thread only. Threads started before (libzmq's I/O thread,
which a side-task worker starts with its first socket) keep running anywhere at
the old priority: a worker meant to share one stage's core at the lowest
priority would take each of its messages on any core at the training's
priority. Threads started afterwards inherit the calling thread's settings.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

__all__ = ["lower_priority", "pin", "threads"]

logger = logging.getLogger(__name__)


def threads() -> list[int]:
    """The ids of this process's threads (``[0]``, the calling one, where ``/proc`` cannot be read)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def pin(cores: Iterable[int]) -> None:
    """Run every thread of this process on ``cores`` only."""
    allowed = set(cores)
    for tid in threads():
        try:
            os.sched_setaffinity(tid, allowed)
        except OSError as exc:  # a thread that ended meanwhile
            logger.debug("[cores] thread %d: %s", tid, exc)


def lower_priority(nice: int) -> None:
    """Set every thread of this process to nice level ``nice`` (only ever lowered: raising it needs privileges)."""
    for tid in threads():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError as exc:
            logger.debug("[priority] thread %d: %s", tid, exc)
