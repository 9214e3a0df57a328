"""Both adapters on the device's timeline: receives return to the host at once, the device waits.

DeepSpeed runs its real TrainSchedule on the stand-in engine of
``test_deepspeed_adapter`` whose receives cost the host nothing and the device
the time the 1F1B simulation says; Megatron's adapter is driven call by call as
its patches drive it. The CUDA events are the lock-step stand-in of
``tests/standins/fake_cuda.py`` (no CUDA on CPU machines): the fake engine
moves the device clock and each event completes at the device time it is
recorded at.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, cast

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
from _files import load
from test_deepspeed_adapter import T_B, T_F, Clock, FakeEngine, Recorder  # tests/unit is on sys.path

from freeride import protocol as p
from freeride.backends import session as session_mod
from freeride.backends.cuda_timing import DeviceTimeline, choose_timing
from freeride.backends.deepspeed.adapter import DeepSpeedAdapter
from freeride.backends.megatron import _compat as mg_compat
from freeride.backends.megatron import adapter as mg_adapter
from freeride.backends.schedule import Action
from freeride.backends.session import BackendConfig, BackendSession
from freeride.transport import EventEmitter

MS = 1_000_000


def _standin() -> ModuleType:
    return load("tests/standins/fake_cuda.py", "fake_cuda_adapters")


fake_cuda = _standin()


class NcclEngine(FakeEngine):
    """Receives return to the host at once; the device waits as long as the schedule says."""

    gpu: Any = None

    def _compute(self, kind: str) -> None:
        super()._compute(kind)
        self.gpu.advance((T_F if kind == "F" else T_B) / MS)

    def _recv(self, kind: str) -> None:
        before = self.clock.now
        super()._recv(kind)
        self.gpu.advance((self.clock.now - before) / MS)
        self.clock.now = before  # the host did not wait


def _started(events: list[p.BackendEvent]) -> list[p.BubbleStarted]:
    return [e for e in events if isinstance(e, p.BubbleStarted)]


def _ended(events: list[p.BackendEvent]) -> list[p.BubbleEnded]:
    return [e for e in events if isinstance(e, p.BubbleEnded)]


def test_deepspeed_bubbles_follow_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(session_mod, "time", type("T", (), {"monotonic_ns": staticmethod(clock.monotonic_ns)}))
    gpu = fake_cuda.FakeGpu(lockstep=True)
    engine = NcclEngine(clock, stage=1, stages=2, micro_batches=4)
    engine.gpu = gpu
    reduced: set[int] = set()

    def all_reduce(*args: Any, **kwargs: Any) -> None:
        # the gradient-norm all-reduce waits for the other stage, on the device only
        if engine.global_steps not in reduced:
            reduced.add(engine.global_steps)
            gpu.advance(engine.waits["tail:opt0"] / MS)

    monkeypatch.setattr("deepspeed.comm.all_reduce", all_reduce)
    recorder = Recorder()
    config = BackendConfig(
        endpoint="ipc:///nonexistent", rank=1, stage=1, num_stages=2, device="cuda:0", framework="deepspeed"
    )
    session = BackendSession(config, emitter=cast(EventEmitter, recorder))
    timeline = DeviceTimeline(session, api=gpu.api(), clock=gpu.host_ns)
    adapter = DeepSpeedAdapter(engine, session=session, mode="emit", clock=clock.monotonic_ns, timeline=timeline)
    original_exec = FakeEngine._exec_schedule
    original_loss = FakeEngine._aggregate_total_loss
    monkeypatch.setattr(engine, "_exec_schedule", lambda sched: adapter.run_schedule(original_exec, engine, sched))
    monkeypatch.setattr(engine, "_aggregate_total_loss", lambda: adapter.run_aggregate_loss(original_loss, engine))
    for _ in range(4):
        engine.train_batch()
    adapter.close()
    started, ended = _started(recorder.events), _ended(recorder.events)
    assert started and len(started) == len(ended)
    # stage 1 waits f for its first input and b at the gradient-norm all-reduce, on the device only
    truth = {0: engine.waits[str(Action(1, "F", 0))], 1: engine.waits["tail:opt0"]}
    assert truth == {0: T_F, 1: T_B}
    for s, e in zip(started, ended, strict=True):
        assert e.duration_ns == pytest.approx(truth[s.index], rel=0.01)
    last = [s for s in started if s.step == started[-1].step]
    assert [(s.index, s.expected_ns) for s in last] == [(i, pytest.approx(ns, rel=0.01)) for i, ns in truth.items()]
    # timestamps are the device's: each bubble ends where the device resumed
    for s, e in zip(started, ended, strict=True):
        assert e.t_ns - s.t_ns == e.duration_ns
    assert isinstance(recorder.events[-1], p.Goodbye)
    assert timeline.accuracy.waits >= len(ended)


class _FakeRankDevice:
    cuda = True
    name = "cuda:0"
    memory = 80 << 30

    def spare_memory(self) -> int:
        return 40 << 30

    def settle(self) -> None:
        raise AssertionError("device timing must not synchronise the stream")

    def start(self) -> int:
        return 0

    def stop(self, kind: str, started: Any) -> list[tuple[str, int]]:
        return [(kind, T_F if kind == "F" else T_B)]


def test_megatron_picks_the_device_timeline_on_cuda_with_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = fake_cuda.FakeGpu(lockstep=True)
    recorder = Recorder()
    info = mg_compat.CallInfo(
        num_stages=2,
        stage=1,
        num_microbatches=4,
        num_chunks=1,
        group_size=2,
        forward_only=False,
        overlap_p2p_comm=False,
        combined_1f1b=False,
        has_finalize=False,
        config=None,
    )
    monkeypatch.setattr(mg_compat, "call_info", lambda kwargs: info)
    monkeypatch.setattr(mg_adapter, "RankDevice", _FakeRankDevice)
    monkeypatch.setattr(
        mg_adapter, "BackendSession", lambda config: BackendSession(config, emitter=cast(EventEmitter, recorder))
    )
    monkeypatch.setattr("freeride.backends.cuda_timing.p2p_backend", lambda: "nccl")
    monkeypatch.delenv("FREERIDE_BUBBLE_TIMING", raising=False)
    adapter = mg_adapter.MegatronAdapter(device_api=gpu.api())
    waits = {(0, "F"): 30.0}  # stage 1 waits f + b for its first input on the device
    for _ in range(3):
        assert adapter.step_begin("forward_backward_pipelining_without_interleaving", {})
        tracker = adapter._tracker
        assert tracker is not None
        for action in tracker.plan.actions if tracker.plan is not None else ():
            adapter.wait_begin()
            gpu.advance(waits.get((action.microbatch, action.kind), 0.0))
            adapter.wait_end()
            started = adapter.compute_begin(action.kind)
            gpu.advance((T_F if action.kind == "F" else T_B) / MS)
            adapter.compute_end(action.kind, started)
        adapter.step_end(True)
    assert adapter._timeline is not None
    timeline = adapter._timeline
    adapter.close()
    ended = _ended(recorder.events)
    assert ended and all(e.duration_ns == pytest.approx(30 * MS, rel=0.01) for e in ended)
    assert timeline.accuracy.waits >= len(ended)


def test_host_timing_stays_on_cpu_and_can_be_forced_on_cuda() -> None:
    assert choose_timing("auto", device_type=torch.device("cpu").type, p2p_backend="gloo") == "host"
    assert choose_timing("host", device_type="cuda", p2p_backend="nccl") == "host"
