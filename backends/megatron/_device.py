"""The device a megatron rank computes on: its name, memory and compute timing.

On a GPU, compute is timed with CUDA events read once they completed (no
synchronisation on the training path). On CPU, where one pinned core stands in
for a device, it is timed on the host clock.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from freeride.backends.schedule import Kind
from freeride.host.memory import rank_share

__all__ = ["RankDevice"]


def _cpu_device() -> str:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) == 1:
        return f"cpu:{cores[0]}"
    local = int(os.environ.get("LOCAL_RANK", "0") or 0)
    return f"cpu:{cores[local % len(cores)]}"


class RankDevice:
    """Name, memory and compute timing of the device this rank computes on."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._event: Callable[..., Any] = torch.cuda.Event
        self.cuda = bool(torch.cuda.is_available()) and not _cpu_shim_active()
        self._pending: list[tuple[Kind, Any, Any]] = []
        if self.cuda:
            index = torch.cuda.current_device()
            self.name = f"cuda:{index}"
            self.memory = int(torch.cuda.get_device_properties(index).total_memory)
        else:
            self.name = _cpu_device()
            _, self.memory = rank_share()

    def spare_memory(self) -> int:
        """Bytes the rank leaves free: on a GPU its total minus what PyTorch reserved at most,
        on CPU the available memory shared by the node's ranks (-1 if unknown)."""
        if self.cuda:
            return self.memory - int(self._torch.cuda.max_memory_reserved())
        return rank_share()[0]

    def settle(self) -> None:
        """Wait for this rank's queued kernels (GPU only)."""
        self._torch.cuda.current_stream().synchronize()

    def start(self) -> Any:
        """Open a compute interval (a host timestamp, or a recorded CUDA event)."""
        if not self.cuda:
            return time.perf_counter_ns()
        event = self._event(enable_timing=True)
        event.record()
        return event

    def stop(self, kind: Kind, started: Any) -> list[tuple[Kind, int]]:
        """Close a compute interval; returns the intervals whose duration is known now."""
        if not self.cuda:
            return [(kind, time.perf_counter_ns() - started)]
        end = self._event(enable_timing=True)
        end.record()
        self._pending.append((kind, started, end))
        done: list[tuple[Kind, int]] = []
        while self._pending and self._pending[0][2].query():
            k, a, b = self._pending.pop(0)
            done.append((k, round(a.elapsed_time(b) * 1e6)))
        return done


def _cpu_shim_active() -> bool:
    from freeride.backends.megatron import cpu_shim

    return cpu_shim.active()
