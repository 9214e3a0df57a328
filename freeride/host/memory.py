"""The node's memory as the kernel states it (``/proc/meminfo``), and one rank's share of it."""

from __future__ import annotations

import os

__all__ = ["local_ranks", "meminfo", "rank_share"]


def meminfo(field: str) -> int:
    """A ``/proc/meminfo`` field (``MemAvailable``, ``MemTotal``, ...) in bytes; -1 where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name == field:
                    return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return -1


def local_ranks() -> int:
    """How many training ranks share this node, as the launcher says (torchrun's ``LOCAL_WORLD_SIZE``,
    DeepSpeed's ``LOCAL_SIZE``); 1 where none says."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def rank_share() -> tuple[int, int]:
    """(available, total) host memory of one rank on CPU, where one core stands in for a device:
    the node's shared by its local ranks; -1 where unknown."""
    ranks = local_ranks()
    available, total = meminfo("MemAvailable"), meminfo("MemTotal")
    return (available // ranks if available >= 0 else -1), (total // ranks if total >= 0 else -1)
