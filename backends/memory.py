"""How much memory a rank's device has, and how much the rank leaves free for side tasks."""

from __future__ import annotations

import logging

from freeride.host.memory import rank_share

__all__ = ["device_memory"]

logger = logging.getLogger(__name__)


def device_memory(device_type: str, device_index: int) -> tuple[int, int]:
    """(spare, total) bytes of the device one rank computes on; -1 where unknown.

    On a GPU: its total minus the most PyTorch's caching allocator has reserved.
    On CPU (one core standing in for a device): the node's available and total
    memory, shared by its local ranks.
    """
    if device_type != "cuda":
        return rank_share()
    try:
        import torch

        total = int(torch.cuda.get_device_properties(device_index).total_memory)
        return total - int(torch.cuda.max_memory_reserved(device_index)), total
    except Exception:
        logger.debug("[memory] cannot read memory of %s:%d", device_type, device_index, exc_info=True)
        return -1, -1
