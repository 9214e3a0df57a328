"""Where the manager's own threads run: on cores no training rank uses, where there are some.

On a node with cores to spare beside the training ranks (a GPU node, where
each rank drives a device from a core or two and is pinned there), the
manager keeps to those and never takes a rank's core. Where every core is a
rank's (the CPU stand-in, or ranks left unpinned) it stays where it was and
says so. Each thread is moved (Linux keeps affinity per thread); threads
started later inherit it from the thread that starts them.

Lowering the manager's priority where no core is spare (nice 10) was
measured and did not resolve a change in the simulated pipeline's slowdown
(docs/benchmarks.md): an unprivileged process could not undo it, and the
side tasks it starts would inherit it, so it is not done.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

from freeride.host.threads import pin

__all__ = ["OwnCores", "Placement", "place_manager"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the manager's threads go."""

    cores: frozenset[int]
    """The cores they may run on."""
    reason: str
    """What ``freeride status`` says about it ("": no rank trains on a core the manager may use)."""


def _span(cores: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cores))


def place_manager(allowed: frozenset[int], training: frozenset[int]) -> Placement:
    """Where the manager goes, given the cores it may use and those the live training ranks may run on."""
    busy = allowed & training
    if not busy:
        return Placement(allowed, "")
    spare = allowed - training
    if spare:
        return Placement(spare, f"manager on core(s) {_span(spare)}, none of a training rank's")
    return Placement(
        allowed, f"manager shares the training ranks' cores ({_span(allowed)}): no core it may use is spare"
    )


class OwnCores:
    """Applies :func:`place_manager` to this process as the training ranks come and go."""

    def __init__(self) -> None:
        self.allowed = frozenset(os.sched_getaffinity(0))
        self.placement = Placement(self.allowed, "")

    def update(self, training: frozenset[int]) -> None:
        """Move this process's threads for ranks training on ``training`` now (nothing if unchanged)."""
        target = place_manager(self.allowed, training)
        if target == self.placement:
            return
        if target.cores != self.placement.cores:
            pin(target.cores)
        self.placement = target
        if target.reason:
            logger.info("[cores] %s", target.reason)
