"""A stand-in for the few torch.cuda calls the device timeline makes, because no CUDA exists on CPU machines.

One :class:`FakeGpu` has a device clock (ms) the test moves and streams that
run what was recorded on them in order. An event recorded on the compute
stream completes when the test says the device got there (:meth:`FakeGpu.reach`);
one recorded on a stream with nothing queued (the calibration stream)
completes at once, at the current device time. ``synchronize`` blocks the
calling thread until its event completes, as a blocking-sync CUDA event does.
With ``lockstep=True`` the compute stream is never behind: its events complete
when recorded, at the device time the test (a fake engine) has moved to with
:meth:`FakeGpu.advance`. The host clock of the test is tied to the device clock
by ``host_offset_ns``, so device-derived timestamps can be checked exactly.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from freeride.backends.device_clock import DeviceApi

__all__ = ["FakeEvent", "FakeGpu", "FakeStream"]


class FakeStream:
    def __init__(self, gpu: FakeGpu, *, busy: bool) -> None:
        self.gpu = gpu
        self.busy = busy
        """Events recorded here wait for :meth:`FakeGpu.reach`; otherwise they complete at once."""


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self._gpu = gpu
        self.at_ms: float | None = None
        self.records = 0

    def record(self, stream: Any = None) -> None:
        stream = self._gpu.compute if stream is None else stream
        self.records += 1
        with self._gpu.cond:
            self.at_ms = None
            if stream.busy:
                self._gpu.queued.append(self)
            else:
                self.at_ms = self._gpu.now_ms
                self._gpu.cond.notify_all()

    def query(self) -> bool:
        with self._gpu.cond:
            return self.at_ms is not None

    def synchronize(self) -> None:
        with self._gpu.cond:
            if not self._gpu.cond.wait_for(lambda: self.at_ms is not None, timeout=10):
                raise TimeoutError("fake event never reached")

    def elapsed_time(self, end_event: Any) -> float:
        assert self.at_ms is not None and end_event.at_ms is not None, "elapsed_time on an incomplete event"
        return float(end_event.at_ms - self.at_ms)


class FakeGpu:
    """The device clock and the compute stream's queue of recorded events."""

    def __init__(self, *, host_offset_ns: int = 7_000_000_000, lockstep: bool = False) -> None:
        self.cond = threading.Condition()
        self.now_ms = 0.0
        self.queued: deque[FakeEvent] = deque()
        self.compute = FakeStream(self, busy=not lockstep)
        self.events_created = 0
        self.host_offset_ns = host_offset_ns

    def host_ns(self) -> int:
        """The host's monotonic clock, tied to the device's."""
        with self.cond:
            return self.host_offset_ns + round(self.now_ms * 1e6)

    def reach(self, at_ms: float) -> None:
        """The compute stream gets to its oldest recorded event at device time ``at_ms``."""
        with self.cond:
            self.now_ms = at_ms
            event = self.queued.popleft()
            event.at_ms = at_ms
            self.cond.notify_all()

    def advance(self, ms: float) -> None:
        """The device computes (or waits) for ``ms``."""
        with self.cond:
            self.now_ms += ms

    def wait_queued(self, n: int) -> None:
        """Block until ``n`` events wait on the compute stream."""
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.queued) >= n, timeout=10)

    def _event(self) -> FakeEvent:
        self.events_created += 1
        return FakeEvent(self)

    def api(self) -> DeviceApi:
        return DeviceApi(
            event=self._event,
            stream=lambda: FakeStream(self, busy=False),
            current_stream=lambda: self.compute,
        )
