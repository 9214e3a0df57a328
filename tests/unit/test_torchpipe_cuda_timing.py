"""The torchpipe adapter on the device's timeline: ``_wait_batch_p2p`` returns to the host at once, the device waits.

With NCCL, torch's ``Work.wait()`` only makes the compute stream wait for the
receive; the host goes on queueing kernels. The adapter is driven call by call
as torch's ``Schedule1F1B`` drives it on the last of 2 ranks (the hooks of
:mod:`freeride.backends.torchpipe`), with the host clock standing still in every wait
and the device clock moving instead. The CUDA events are the lock-step
stand-in of ``tests/standins/fake_cuda.py`` (no CUDA on CPU machines): each
event completes at the device time it is recorded at.
"""

from __future__ import annotations

import threading
from types import ModuleType, SimpleNamespace
from typing import Any, cast

import pytest
from _files import load
from test_deepspeed_adapter import Clock, Recorder  # tests/unit is on sys.path

from freeride import protocol as p
from freeride.backends import cuda_timing
from freeride.backends import session as session_mod
from freeride.backends.cuda_timing import DeviceTimeline
from freeride.backends.session import BackendConfig, BackendSession
from freeride.backends.torchpipe.adapter import TorchPipeAdapter
from freeride.transport import EventEmitter

MS = 1_000_000
M = 4
T_F, T_B = 10 * MS, 20 * MS
HEAD, STEADY = 30 * MS, 6 * MS
"""Device waits of rank 1 before its first forward, and before each later one."""


class StepRecorder(Recorder):
    """Also tells the test when the helper thread has sent a step's report (it has timed that step's waits)."""

    def __init__(self) -> None:
        super().__init__()
        self.step_done = threading.Semaphore(0)

    def wait_connected(self, timeout_ms: int) -> bool:

        return True

    def emit(self, event: p.BackendEvent) -> bool:
        sent = super().emit(event)
        if isinstance(event, p.StepFinished):
            self.step_done.release()
        return sent


def _standin() -> ModuleType:
    return load("tests/standins/fake_cuda.py", "fake_cuda_torchpipe")


fake_cuda = _standin()


class Schedule1F1B(SimpleNamespace):
    """Named as torch's class: the adapter reads the name."""


def irecv() -> None: ...


def isend() -> None: ...


def _cuda_schedule() -> Schedule1F1B:
    stage = SimpleNamespace(num_stages=2, stage_index=1, device=SimpleNamespace(type="cuda", index=0))
    return Schedule1F1B(_stage=stage, _n_microbatches=M, _has_backward=True, pipeline_order=None)


def _step(adapter: TorchPipeAdapter, schedule: Any, gpu: Any, clock: Clock) -> None:
    """Rank 1 of Schedule1F1B: recv F0, F0, B0, then send+recv, F, B per micro-batch, drain the sends."""
    recv, send = [SimpleNamespace(op=irecv)], [SimpleNamespace(op=isend)]

    def wait(ops: list[Any], device_ms: float) -> None:
        works = [object()]
        adapter.posted(ops, works)
        adapter.wait(lambda w: gpu.advance(device_ms), works)  # the host returns at once

    def compute(kind: Any, ns: int) -> None:
        def run() -> None:
            clock.advance(ns // 100)  # the host only queues the kernels
            gpu.advance(ns / MS)

        adapter.compute(kind, run, (), {})

    def body(schedule: Any) -> None:
        for mb in range(M):
            wait(recv if mb == 0 else send + recv, (HEAD if mb == 0 else STEADY) / MS)
            compute("F", T_F)
            compute("B", T_B)
        wait(send, 0.0)

    adapter.run_step(body, schedule, (), {})


def test_waits_are_announced_and_timed_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(session_mod, "time", type("T", (), {"monotonic_ns": staticmethod(clock.monotonic_ns)}))
    gpu = fake_cuda.FakeGpu(lockstep=True)
    recorder = StepRecorder()
    config = BackendConfig(
        endpoint="ipc:///nonexistent", rank=1, stage=1, num_stages=2, device="cuda:0", framework="torchpipe"
    )
    session = BackendSession(config, emitter=cast(EventEmitter, recorder))
    timeline = DeviceTimeline(session, api=gpu.api(), clock=gpu.host_ns)
    schedule = _cuda_schedule()
    adapter = TorchPipeAdapter(schedule, session=session, mode="emit", clock=clock.monotonic_ns, timeline=timeline)
    assert adapter.device == "cuda:0" and adapter.tracker is not None
    for _ in range(5):
        host_before = clock.now
        _step(adapter, schedule, gpu, clock)
        assert clock.now - host_before < (T_F + T_B) * M // 10  # the host never waited
        # the device's durations reach the tracker from the helper thread: the next step learns from them.
        # A step's report waits for the rank's next event; a heartbeat (queued behind the step) sends it.
        timeline.heartbeat()
        assert recorder.step_done.acquire(timeout=10)
    adapter.close()

    started = [e for e in recorder.events if isinstance(e, p.BubbleStarted)]
    ended = [e for e in recorder.events if isinstance(e, p.BubbleEnded)]
    assert started and len(started) == len(ended)
    # every wait after the first step is announced, with the device's length, predicted and measured
    truth = {0: HEAD, 1: STEADY, 2: STEADY, 3: STEADY}
    last = [s for s in started if s.step == started[-1].step]
    assert [(s.index, s.expected_ns) for s in last] == [(i, pytest.approx(ns, rel=0.01)) for i, ns in truth.items()]
    for s, e in zip(started, ended, strict=True):
        assert e.duration_ns == pytest.approx(truth[s.index], rel=0.01)
        assert e.t_ns - s.t_ns == e.duration_ns  # device timestamps: the bubble ends where the device resumed
    assert isinstance(recorder.events[-1], p.Goodbye)
    assert timeline.accuracy.waits >= len(ended)


def test_auto_timing_picks_the_device_on_cuda_with_nccl_and_the_host_with_gloo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = fake_cuda.FakeGpu(lockstep=True)
    monkeypatch.setattr(cuda_timing, "torch_device_api", gpu.api)
    monkeypatch.delenv(cuda_timing.ENV_TIMING, raising=False)
    config = BackendConfig(
        endpoint="ipc:///nonexistent", rank=1, stage=1, num_stages=2, device="cuda:0", framework="torchpipe"
    )
    for backend, forced, device_timed in (("nccl", None, True), ("gloo", None, False), ("nccl", "host", False)):
        monkeypatch.setattr(cuda_timing, "p2p_backend", lambda b=backend: b)
        session = BackendSession(config, emitter=cast(EventEmitter, Recorder()))
        schedule = _cuda_schedule()
        adapter = TorchPipeAdapter(schedule, session=session, mode="emit", timing=forced)
        assert (adapter.timeline is not None) is device_timed, (backend, forced)
        adapter.close()
        assert adapter.closed
