"""The device timeline on a real GPU: a bubble the host skips past is announced when the device gets there.

A one-thread spin kernel on a second stream plays an NCCL receive: the host
returns at once, the compute stream waits for it. Before it, the compute stream
has ~30 ms of queued work, so a bubble announced by the host would start ~30 ms
early; the device timeline must start it when the device reaches the wait and
measure the spin's length, within a millisecond. Both spins are timed by CUDA
events too: a spin's cycles take less time once the clock boosts (an H200 ran
a "30 ms" spin, calibrated at idle, in 22.7 ms).
"""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import pytest

from freeride import protocol as p
from freeride.backends.cuda_timing import DeviceTimeline
from freeride.backends.session import BackendConfig, BackendSession
from freeride.transport import EventEmitter

pytestmark = pytest.mark.gpu

MS = 1_000_000


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[int, p.BackendEvent]] = []
        self.cond = threading.Condition()
        self.dropped = self.sent = 0

    def wait_connected(self, timeout_ms: int) -> bool:

        return True

    def emit(self, event: p.BackendEvent) -> bool:
        with self.cond:
            self.events.append((time.monotonic_ns(), event))
            self.cond.notify_all()
        return True

    def close(self, goodbye: p.Goodbye | None = None, *, linger_ms: int = 200) -> None:
        pass


def _cycles_per_ms(cuda: Any) -> float:
    start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
    start.record()
    cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / float(start.elapsed_time(end))


def test_bubble_starts_when_the_device_reaches_it_and_lasts_what_events_measure() -> None:
    import torch

    cuda: Any = torch.cuda
    per_ms = _cycles_per_ms(cuda)
    recorder = Recorder()
    config = BackendConfig(
        endpoint="ipc:///nonexistent", rank=0, stage=0, num_stages=2, device="cuda:0", framework="test"
    )
    session = BackendSession(config, emitter=cast(EventEmitter, recorder))
    timeline = DeviceTimeline(session)
    comm = cuda.Stream()
    try:
        compute = cuda.current_stream()
        # the device's own clock of both spins: their cycles per ms move with its boost clock
        busy0, busy1, recv0, recv1 = (cuda.Event(enable_timing=True) for _ in range(4))
        host_t0 = time.monotonic_ns()
        busy0.record()
        cuda._sleep(int(30 * per_ms))  # queued compute: the device is busy for ~30 ms
        busy1.record()
        timeline.wait_began((1, 20 * MS, None))
        comm.wait_stream(compute)
        with cuda.stream(comm):
            recv0.record()
            cuda._sleep(int(20 * per_ms))  # the "receive": ~20 ms on the device
            recv1.record()
        compute.wait_stream(comm)
        timeline.wait_finished("w")
        host_returned = time.monotonic_ns() - host_t0
        assert host_returned < 10 * MS  # the host did not wait
        with recorder.cond:
            assert recorder.cond.wait_for(
                lambda: any(isinstance(e, p.BubbleEnded) for _, e in recorder.events), timeout=10
            )
        started = next(e for _, e in recorder.events if isinstance(e, p.BubbleStarted))
        ended = next(e for _, e in recorder.events if isinstance(e, p.BubbleEnded))
        busy_ns = busy0.elapsed_time(busy1) * MS
        recv_ns = recv0.elapsed_time(recv1) * MS
        assert busy_ns > 10 * MS  # the queued work outlasts the host's own path by far
        assert started.t_ns - host_t0 == pytest.approx(busy_ns, abs=3 * MS)  # when the device got there
        assert ended.duration_ns == pytest.approx(recv_ns, abs=1 * MS)
        summary = timeline.accuracy.summary()
        assert summary["lag_p50_ms"] < 2.0  # the helper thread wakes promptly on the event
    finally:
        timeline.close()


def test_side_stream_is_lowest_priority_and_step_end_waits_for_the_device() -> None:
    import torch

    from freeride.gpu.streams import use_side_stream

    setup = use_side_stream("cuda:0")
    assert setup is not None
    least, _ = torch.cuda.Stream.priority_range()
    assert setup.priority == least
    cuda: Any = torch.cuda
    t0 = time.monotonic_ns()
    cuda._sleep(int(20 * _cycles_per_ms(cuda)))
    setup.sync_step_end()
    assert time.monotonic_ns() - t0 >= 15 * MS
    torch.cuda.set_stream(torch.cuda.default_stream())
