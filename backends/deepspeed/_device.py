"""Which device a DeepSpeed rank computes on, and how much of its memory it leaves free."""

from __future__ import annotations

import logging
import os

from freeride.backends.deepspeed import _compat

__all__ = ["device_memory", "device_name"]

logger = logging.getLogger(__name__)


def device_memory(device_type: str, device_index: int) -> tuple[int, int]:
    """(spare, total) bytes of the device one rank computes on; -1 where unknown.

    On GPU: total minus the most the caching allocator has reserved. On CPU (one core
    standing in for a device): MemAvailable and MemTotal shared by the node's local ranks.
    """
    try:
        if device_type == "cuda":
            import torch

            total = int(torch.cuda.get_device_properties(device_index).total_memory)
            return total - int(torch.cuda.max_memory_reserved(device_index)), total
        fields: dict[str, int] = {}
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields[name] = int(rest.split()[0]) * 1024
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or "1"))
        return fields["MemAvailable"] // local, fields["MemTotal"] // local
    except Exception:
        logger.debug("[memory] cannot read memory of %s:%d", device_type, device_index, exc_info=True)
        return -1, -1


def device_name(facts: _compat.EngineFacts) -> str:
    """``cuda:<index>``; on CPU ``cpu:<core>``, the core the rank is pinned to."""
    if facts.device_type != "cpu":
        return f"{facts.device_type}:{facts.device_index}"
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) == 1:
        return f"cpu:{cores[0]}"
    return f"cpu:{facts.local_rank % (os.cpu_count() or 1)}"
