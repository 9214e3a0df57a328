"""A side task's CUDA stream and the end of its steps on the device.

* Side-task kernels go to a stream of the lowest priority the device offers, so
  that within the process its work yields to nothing urgent and, under MPS, the
  server ranks it below normal streams. Priorities do not preempt running
  kernels; they order what waits.
* An iterative task's step ends when its device work ends, not when the host
  has queued it: the gate waits for an event recorded at the step's end on the
  task's stream (blocking sync, so the worker sleeps), never for the whole
  device, which would also wait for other streams.

On CPU devices both are no-ops and torch.cuda is never touched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["DeviceEvent", "StreamSetup", "step_end_sync", "timing_event", "use_side_stream"]

logger = logging.getLogger(__name__)

_LEAST_URGENT = 1 << 16


class DeviceEvent(Protocol):
    """What is used of a ``torch.cuda.Event`` (tests pass stand-ins)."""

    def record(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...


def timing_event() -> DeviceEvent:
    """A new CUDA timing event that a thread waits for asleep (blocking sync), on the calling thread's device."""
    import torch

    cuda: Any = torch.cuda  # Event's constructor is untyped
    event: DeviceEvent = cuda.Event(enable_timing=True, blocking=True)
    return event


class StreamSetup:
    """What :func:`use_side_stream` set up: the stream, its priority, the step-end sync."""

    def __init__(self, stream: Any, priority: int, cuda: Any) -> None:
        self.stream = stream
        self.priority = priority
        self._cuda = cuda

    def sync_step_end(self) -> None:
        """Wait until the device has run what the step queued on the task's stream."""
        event = self._cuda.Event(blocking=True)
        event.record(self.stream)
        event.synchronize()


def use_side_stream(torch_device: str, *, cuda: Any = None) -> StreamSetup | None:
    """Make a lowest-priority stream the calling thread's current stream on ``torch_device``.

    Args:
        torch_device: ``cuda:N`` or ``cpu``.
        cuda: The ``torch.cuda`` module (tests pass a stand-in).

    Returns:
        The setup, or None on CPU.
    """
    if not torch_device.startswith("cuda"):
        return None
    if cuda is None:
        import torch

        cuda = torch.cuda
    # numerically lower is more urgent; torch maps a value beyond the device's range to
    # the nearest end, so a large positive number is the least urgent where
    # priority_range() is missing
    ranged = getattr(cuda.Stream, "priority_range", None)
    least = int(ranged()[0]) if callable(ranged) else _LEAST_URGENT
    stream = cuda.Stream(device=torch_device, priority=least)
    cuda.set_stream(stream)
    priority = int(getattr(stream, "priority", least))
    logger.info("[worker] side-task stream at priority %d on %s", priority, torch_device)
    return StreamSetup(stream, priority, cuda)


def step_end_sync(setup: StreamSetup | None) -> Callable[[], None] | None:
    """The gate's step-end hook for ``setup`` (None on CPU)."""
    return None if setup is None else setup.sync_step_end
