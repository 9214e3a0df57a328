"""Time a CPU rank was kept from running: waiting for its core, or its core taken by the hypervisor.

Each training script reports it per step as ``lost_ms``: on a quiet machine it
is near zero; when other work shares the rank's core (or the host steals the
virtual core) it grows, and every timing the step reports is stretched by up to
that much. Tests that compare timings compare only runs where it stayed small.

Two counters, both read where Linux keeps them: the calling thread's run delay
(``/proc/thread-self/schedstat``, field 2, ns) and the steal time of the one core
the rank is pinned to (``/proc/stat``, the ``cpuN`` line's 8th value, in clock
ticks). A counter that cannot be read counts 0.
"""

from __future__ import annotations

import os

__all__ = ["LostTime"]

_TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")


def _run_delay_ns() -> int:
    try:
        with open("/proc/thread-self/schedstat", encoding="ascii") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _steal_ns(core: int | None) -> float:
    if core is None:
        return 0.0
    label = f"cpu{core}"
    try:
        with open("/proc/stat", encoding="ascii") as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] == label:
                    return int(fields[8]) * _TICK_NS
    except (OSError, IndexError, ValueError):
        pass
    return 0.0


class LostTime:
    """``take()``: ms lost since the last call (or construction), in the thread that calls it."""

    def __init__(self) -> None:
        cores = os.sched_getaffinity(0)
        self._core = next(iter(cores)) if len(cores) == 1 else None
        """The pinned core whose steal time counts (None: not pinned to one, steal not counted)."""
        self._delay, self._steal = _run_delay_ns(), _steal_ns(self._core)

    def take(self) -> float:
        delay, steal = _run_delay_ns(), _steal_ns(self._core)
        lost = (delay - self._delay) + (steal - self._steal)
        self._delay, self._steal = delay, steal
        return round(lost / 1e6, 3)
