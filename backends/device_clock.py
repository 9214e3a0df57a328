"""The device's clock tied to the host's: CUDA timing events and a calibration pair.

A CUDA event records when the device reached a point of a stream; the host
learns it later. :func:`calibrate` records one on a stream with nothing queued
(it completes as soon as it is recorded) between two host readings, so that
every later event of the same device converts to the host's monotonic clock
(:meth:`Calibration.host_time`) within a known error. The device timeline of a
training stage and the GPU check's gate benchmark both use it.

No CUDA exists on CPU machines: the few calls used are gathered in
:class:`DeviceApi`, which tests replace by a stand-in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from freeride.gpu.streams import DeviceEvent, timing_event

__all__ = ["Calibration", "DeviceApi", "DeviceEvent", "calibrate", "torch_device_api"]

_CALIBRATION_TRIES = 5


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceApi:
    """The CUDA calls the timeline makes (a stand-in replaces them in tests)."""

    event: Callable[[], DeviceEvent]
    """A new timing event that the helper thread can wait for without spinning."""
    stream: Callable[[], Any]
    """A new stream of the stage's device, for calibration only."""
    current_stream: Callable[[], Any]
    """The stream the training thread computes on now."""
    use_device: Callable[[Any], None] = lambda device: None
    """Make ``device`` (a stream's ``.device``) the calling thread's: a new thread starts on device 0, and its
    calibration stream, events and the gate's registration must be on the stage's device."""


def torch_device_api() -> DeviceApi:
    """The real calls, through ``torch.cuda`` (blocking-sync events: the helper thread sleeps)."""
    import torch

    cuda: Any = torch.cuda
    return DeviceApi(
        event=timing_event,
        stream=cuda.Stream,
        current_stream=cuda.current_stream,
        use_device=cuda.set_device,
    )


@dataclass(frozen=True, slots=True)
class Calibration:
    """A device event whose time on the host's monotonic clock is known to within :attr:`error_ns`."""

    event: DeviceEvent
    host_ns: int
    """When the device reached :attr:`event`, on the host's clock (the middle of the readings around it)."""
    error_ns: int
    """Half the width of the host readings around it: the bound on its error."""
    taken_ns: int
    """The host reading after it (when it was taken)."""

    def host_time(self, event: DeviceEvent) -> int:
        """When the device reached ``event`` (of the same device), on the host's monotonic clock."""
        return self.host_ns + round(self.event.elapsed_time(event) * 1e6)


def calibrate(
    api: DeviceApi, stream: Any, *, tries: int = _CALIBRATION_TRIES, clock: Callable[[], int] = time.monotonic_ns
) -> Calibration:
    """Tie the device's clock to the host's through an event on ``stream``, a stream with nothing queued.

    Such an event completes as soon as it is recorded: the host readings around
    it bound when that was; the narrowest pair of ``tries`` wins.
    """
    best: tuple[int, int, DeviceEvent] | None = None
    for _ in range(max(1, tries)):
        event = api.event()
        t0 = clock()
        event.record(stream)
        event.synchronize()
        t1 = clock()
        if best is None or t1 - t0 < best[1] - best[0]:
            best = (t0, t1, event)
    assert best is not None  # at least one try
    t0, t1, event = best
    return Calibration(event=event, host_ns=(t0 + t1) // 2, error_ns=(t1 - t0) // 2, taken_ns=t1)
