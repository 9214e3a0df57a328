"""Device-timeline bubbles: announced when the device reaches a wait, timed by its events.

There is no CUDA here: the event and stream calls are the stand-in of
``tests/standins/fake_cuda.py``, whose device clock the test moves. The helper
thread of the timeline is real; the tests wait for what it sends, never sleep.
"""

from __future__ import annotations

import dataclasses
import threading
from types import ModuleType
from typing import cast

import pytest
from _files import load

from freeride import protocol as p
from freeride.backends.cuda_timing import DeviceTimeline, choose_timing, timing_from_env
from freeride.backends.schedule import one_f_one_b
from freeride.backends.session import BackendConfig, BackendSession
from freeride.backends.tracker import StepPlan, StepTracker
from freeride.profile import StepRecord
from freeride.transport import EventEmitter

MS = 1_000_000


def _standin() -> ModuleType:
    return load("tests/standins/fake_cuda.py", "fake_cuda")


fake_cuda = _standin()


class Recorder:
    """Stands in for EventEmitter; lets the test wait for the helper thread's sends."""

    def __init__(self) -> None:
        self.events: list[p.BackendEvent] = []
        self.cond = threading.Condition()
        self.dropped = 0
        self.sent = 0

    def wait_connected(self, timeout_ms: int) -> bool:

        return True

    def emit(self, event: p.BackendEvent) -> bool:
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()
        return True

    def close(self, goodbye: p.Goodbye | None = None, *, linger_ms: int = 200) -> None:
        if goodbye is not None:
            self.emit(goodbye)

    def of(self, kind: type[p.BackendEvent]) -> list[p.BackendEvent]:
        with self.cond:
            return [e for e in self.events if isinstance(e, kind)]

    def wait_for(self, kind: type[p.BackendEvent], n: int) -> list[p.BackendEvent]:
        with self.cond:
            assert self.cond.wait_for(lambda: len([e for e in self.events if isinstance(e, kind)]) >= n, timeout=10)
        return self.of(kind)


def _timeline(min_bubble_ns: int = MS) -> tuple[DeviceTimeline, Recorder, object]:
    gpu = fake_cuda.FakeGpu()
    recorder = Recorder()
    config = BackendConfig(
        endpoint="ipc:///nonexistent",
        rank=0,
        stage=0,
        num_stages=2,
        device="cuda:0",
        framework="test",
        min_bubble_ns=min_bubble_ns,
    )
    session = BackendSession(config, emitter=cast(EventEmitter, recorder))
    return DeviceTimeline(session, api=gpu.api(), clock=gpu.host_ns), recorder, gpu


# ------------------------------------------------------------------ choice


@pytest.mark.parametrize(
    ("forced", "device", "backend", "want"),
    [
        ("auto", "cuda", "nccl", "device"),
        ("auto", "cuda", "gloo", "host"),
        ("auto", "cpu", "gloo", "host"),
        ("host", "cuda", "nccl", "host"),
        ("device", "cuda", "gloo", "device"),
        ("device", "cpu", "gloo", "host"),  # no device timeline without CUDA
    ],
)
def test_timing_follows_where_the_wait_blocks_unless_forced(forced: str, device: str, backend: str, want: str) -> None:
    assert choose_timing(forced, device_type=device, p2p_backend=backend) == want  # type: ignore[arg-type]


def test_timing_env_is_checked() -> None:
    assert timing_from_env({}) == "auto"
    assert timing_from_env({"FREERIDE_BUBBLE_TIMING": "device"}) == "device"
    with pytest.raises(ValueError, match="FREERIDE_BUBBLE_TIMING"):
        timing_from_env({"FREERIDE_BUBBLE_TIMING": "gpu"})


# ---------------------------------------------------------------- timeline


def test_bubble_is_announced_when_the_device_reaches_it_and_timed_by_events() -> None:
    timeline, recorder, gpu = _timeline()
    try:
        # the host reaches the wait while the device still computes: nothing is sent yet
        timeline.wait_began((3, 20 * MS, 123))
        timeline.wait_finished(7)  # an NCCL receive returns to the host at once
        timeline.step_finished(3, 50 * MS)
        gpu.wait_queued(2)  # type: ignore[attr-defined]
        assert recorder.of(p.BubbleStarted) == []
        gpu.reach(12.0)  # type: ignore[attr-defined]  # the device gets to the wait at 12 ms
        (started,) = recorder.wait_for(p.BubbleStarted, 1)
        assert isinstance(started, p.BubbleStarted)
        assert started.t_ns == gpu.host_offset_ns + 12 * MS  # type: ignore[attr-defined]
        assert (started.step, started.expected_ns, started.spare_memory) == (3, 20 * MS, 123)
        assert recorder.of(p.StepFinished) == []  # stays behind the bubble it follows
        gpu.reach(30.5)  # type: ignore[attr-defined]  # the data is there at 30.5 ms
        (ended,) = recorder.wait_for(p.BubbleEnded, 1)
        assert isinstance(ended, p.BubbleEnded)
        assert ended.duration_ns == round(18.5 * MS)
        assert ended.t_ns == started.t_ns + ended.duration_ns
        assert timeline.drain() == [(7, round(18.5 * MS))]
        acc = timeline.accuracy
        assert acc.announced == 1 and acc.waits == 1 and acc.error_ns == [20 * MS - round(18.5 * MS)]
        assert recorder.of(p.StepFinished) == []  # it goes with the rank's next event
    finally:
        timeline.close()
    assert [type(e) for e in recorder.events[-2:]] == [p.StepFinished, p.Goodbye]  # at the latest, with the goodbye


def test_unannounced_waits_are_timed_and_events_are_reused() -> None:
    timeline, recorder, gpu = _timeline()
    try:
        for i in range(3):
            timeline.wait_began(None)
            timeline.wait_finished(i)
            gpu.reach(10.0 * i)  # type: ignore[attr-defined]
            gpu.reach(10.0 * i + 2)  # type: ignore[attr-defined]
            timeline.heartbeat()
            recorder.wait_for(p.Heartbeat, i + 1)
        assert timeline.drain() == [(i, 2 * MS) for i in range(3)]
        assert recorder.of(p.BubbleStarted) == []
        assert gpu.events_created <= 4 + 5  # type: ignore[attr-defined]  # a pool of two pairs, plus calibration
    finally:
        timeline.close()


def test_close_sends_goodbye_after_what_was_queued() -> None:
    timeline, recorder, gpu = _timeline()
    timeline.wait_began((0, 5 * MS, None))
    timeline.wait_finished(None)
    gpu.reach(1.0)  # type: ignore[attr-defined]
    gpu.reach(4.0)  # type: ignore[attr-defined]
    timeline.close()
    timeline.close()  # idempotent
    kinds = [type(e).__name__ for e in recorder.events if not isinstance(e, p.Hello)]
    assert kinds == ["BubbleStarted", "BubbleEnded", "Goodbye"]


# ---------------------------------------------------- tracker in device mode


def test_tracker_learns_device_waits_where_the_host_does_not_wait() -> None:
    """Stage 1 of a 2-stage 1F1B: each receive returns to the host at once, the device waits 20 ms."""
    timeline, recorder, gpu = _timeline()
    host = [1_000 * MS]
    records: list[StepRecord] = []
    tracker = StepTracker(timeline, clock=lambda: host[0], device=timeline, on_step=records.append)
    plan = StepPlan(schedule=one_f_one_b(2, 4), stage=1, merge_tail=True)
    device_ms = 0.0
    try:
        for _ in range(3):
            tracker.begin_step(plan)
            for action in plan.actions:
                tracker.wait_started()
                tracker.wait_ended()  # no host time passes: the receive only queued
                gpu.wait_queued(2)  # type: ignore[attr-defined]
                gpu.reach(device_ms)  # type: ignore[attr-defined]
                device_ms += 20.0 if action.microbatch == 0 and action.kind == "F" else 0.1
                gpu.reach(device_ms)  # type: ignore[attr-defined]
                tracker.action_started(action.kind)
                ns = 10 * MS if action.kind == "F" else 20 * MS
                host[0] += ns
                device_ms += ns / MS
                tracker.record_compute(action.kind, ns)
            tracker.end_step()
            # each step's report goes out with the next step's first bubble
            recorder.wait_for(p.StepFinished, tracker.steps_done - 1)
    finally:
        timeline.close()
    started = [e for e in recorder.of(p.BubbleStarted) if isinstance(e, p.BubbleStarted)]
    # from the second step on, the first wait is predicted from the device's 20 ms, not the host's 0
    last = [e for e in started if e.step == 2]
    assert last and last[0].expected_ns == pytest.approx(20 * MS, rel=0.02)
    ended = [e for e in recorder.of(p.BubbleEnded) if isinstance(e, p.BubbleEnded)]
    assert all(e.duration_ns == pytest.approx(20 * MS, rel=0.02) for e in ended)
    # the step records (profile mode) get the device's waits once they are timed
    first = records[1].waits[0]
    assert first.key == "1F0" and first.duration_ns == pytest.approx(20 * MS, rel=0.02)


def test_the_helper_thread_makes_the_stages_device_its_own_before_its_first_event() -> None:
    """A new thread starts on device 0: a rank on another GPU of the node (``torch.cuda.set_device(local_rank)``,
    every GPU visible) would have its calibration stream and events on device 0, whose times do not compare
    with the compute stream's. The helper thread takes the compute stream's device from its first wait."""
    gpu = fake_cuda.FakeGpu()
    gpu.compute.device = "cuda:3"
    used: list[tuple[object, str]] = []
    api = dataclasses.replace(gpu.api(), use_device=lambda d: used.append((d, threading.current_thread().name)))
    recorder = Recorder()
    config = BackendConfig(
        endpoint="ipc:///nonexistent", rank=0, stage=0, num_stages=2, device="cuda:3", framework="test"
    )
    timeline = DeviceTimeline(BackendSession(config, emitter=cast(EventEmitter, recorder)), api=api, clock=gpu.host_ns)
    try:
        for step in range(2):
            timeline.wait_began((step, 20 * MS, None))
            timeline.wait_finished(None)
            gpu.reach(30.0 * step + 1)
            gpu.reach(30.0 * step + 21)
        recorder.wait_for(p.BubbleEnded, 2)
        assert used == [("cuda:3", "freeride-device-timeline")]  # once, on the helper thread
    finally:
        timeline.close()
