"""Runs quiet enough for checks of timing precision, on a machine whose cores other work may share.

A check that compares two clocks around the same wait, or a bubble's place with a
schedule's, holds on quiet cores. When other work runs on the cores the job's ranks
are pinned to (another job, a process an earlier test left behind, the host stealing
the virtual cores), every timing in a step stretches and the checks miss.

:class:`OtherWork` measures that work over a run: the busy time of this process's
cores (``/proc/stat``: user, system and steal) less the CPU time of this process and of all
its descendants, live or reaped (the training ranks, the manager and its workers), as a share
of the cores' time. The run's own threads contending for a core are the run's and
do not count. :func:`quietest` repeats a run until that share is within a budget,
keeping the quietest; :func:`require_quiet` skips a precision check, saying why and
by how much, when even that run was not quiet. The GPU counterpart is a device
shared with another job: the same checks would not hold there either.
"""

from __future__ import annotations

import os
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from freeride.host.procs import descendants

__all__ = ["ATTEMPTS", "BUDGET", "OtherWork", "quietest", "quietest_async", "require_quiet"]

T = TypeVar("T")

BUDGET = 0.10
"""Largest share of the cores' time other work may take for a precision check to count. Measured on
a 2-core machine: quiet 0.5-2 %; one busy loop beside the job 36-41 %, and the checks missed; a process
busy 2 ms in every 10 on each core (20 % offered), they held."""

ATTEMPTS = 2
"""Runs :func:`quietest` makes at most: a run over budget is made once more, and no more, to bound
what busy cores cost the suite (each run, its length)."""

_TICK_S = 1 / os.sysconf("SC_CLK_TCK")
_BUSY = (0, 1, 2, 7)
"""Of a ``cpuN`` line's values: user, nice, system, steal (guest time is within user). Not irq and
softirq: the kernel's work for the run's own loopback traffic lands there, charged to no process."""


def _busy_s(cores: set[int]) -> float:
    total = 0
    with open("/proc/stat", encoding="ascii") as f:
        for line in f:
            name, _, rest = line.partition(" ")
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
                values = rest.split()
                total += sum(int(values[i]) for i in _BUSY)
    return total * _TICK_S


def _descendants_ticks() -> int:
    """CPU ticks of this process's live descendants, each with what it reaped (utime, stime, cutime, cstime)."""
    total = 0
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue  # gone meanwhile
        # after the name: state, ppid, ... utime and stime are the 12th and 13th, cutime and cstime next
        total += sum(int(v) for v in fields[11:15])
    return total


def _own_s() -> float:
    """CPU time of this process, of the children it reaped, and of its live descendants."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + _descendants_ticks() * _TICK_S


class OtherWork:
    """Started at construction; :meth:`share` is the other work's share of the cores' time since then."""

    def __init__(self) -> None:
        self._cores = os.sched_getaffinity(0)
        self._t0, self._busy0, self._own0 = time.monotonic(), _busy_s(self._cores), _own_s()

    def share(self) -> float:
        wall = time.monotonic() - self._t0
        other = (_busy_s(self._cores) - self._busy0) - (_own_s() - self._own0)
        return max(0.0, other) / (wall * len(self._cores)) if wall > 0 else 0.0


def _pick(runs: list[tuple[float, int, T]]) -> tuple[T, float]:
    lost, _, run = min(runs, key=lambda r: (r[0], r[1]))
    return run, lost


def quietest(attempt: Callable[[int], T], *, attempts: int = ATTEMPTS, budget: float = BUDGET) -> tuple[T, float]:
    """``attempt(i)`` until other work takes at most ``budget`` of the cores meanwhile: that run and its
    share of other work, else the quietest's."""
    runs: list[tuple[float, int, T]] = []
    for i in range(attempts):
        load = OtherWork()
        run = attempt(i)
        runs.append((load.share(), i, run))
        if runs[-1][0] <= budget:
            break
    return _pick(runs)


async def quietest_async(
    attempt: Callable[[int], Awaitable[T]], *, attempts: int = ATTEMPTS, budget: float = BUDGET
) -> tuple[T, float]:
    """:func:`quietest` for an ``attempt`` that is a coroutine function."""
    runs: list[tuple[float, int, T]] = []
    for i in range(attempts):
        load = OtherWork()
        run = await attempt(i)
        runs.append((load.share(), i, run))
        if runs[-1][0] <= budget:
            break
    return _pick(runs)


def require_quiet(other: float, what: str, *, budget: float = BUDGET) -> None:
    """Skip the calling check, saying so, where other work took more than ``budget`` of the cores."""
    if other > budget:
        pytest.skip(
            f"{what}: other work took {other:.0%} of the cores' time (budget {budget:.0%}); "
            "this timing check needs quiet cores"
        )
