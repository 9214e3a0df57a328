"""Which device a DeepSpeed rank computes on."""

from __future__ import annotations

import os

from freeride.backends.deepspeed import _compat

__all__ = ["device_name"]


def device_name(facts: _compat.EngineFacts) -> str:
    """``cuda:<index>``; on CPU ``cpu:<core>``, the core the rank is pinned to."""
    if facts.device_type != "cpu":
        return f"{facts.device_type}:{facts.device_index}"
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) == 1:
        return f"cpu:{cores[0]}"
    return f"cpu:{facts.local_rank % (os.cpu_count() or 1)}"
