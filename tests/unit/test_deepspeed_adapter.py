"""The DeepSpeed adapter's logic, driven by DeepSpeed's real TrainSchedule on a virtual clock.

A stand-in engine executes the schedule exactly as ``PipelineEngine._exec_schedule``
does (instruction table looked up through ``self``), with instructions that only
advance a virtual clock: forward and backward take fixed times, and each receive
waits as long as the 1F1B simulation says this stage waits before that action.
No sockets: events go to an in-memory emitter.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Callable
from types import MethodType
from typing import Any, ClassVar, cast

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed.comm
import torch
from deepspeed.runtime.pipe import schedule as ds_schedule

from freeride import protocol as p
from freeride.backends import session as session_mod
from freeride.backends.deepspeed import _compat
from freeride.backends.deepspeed.adapter import TAIL_LOSS, DeepSpeedAdapter, tail_key
from freeride.backends.schedule import Action, Durations, bubbles, one_f_one_b, simulate
from freeride.backends.session import BackendConfig, BackendSession
from freeride.profile import RankObservations, build_profile
from freeride.transport import EventEmitter

MS = 1_000_000
T_F, T_B = 10 * MS, 20 * MS
LOSS_NS = MS // 10


class Clock:
    def __init__(self) -> None:
        self.now = 1_000 * MS

    def monotonic_ns(self) -> int:
        return self.now

    def advance(self, ns: int) -> None:
        self.now += ns


class Recorder:
    """Stands in for EventEmitter: keeps what would have been sent."""

    def __init__(self) -> None:
        self.events: list[p.BackendEvent] = []
        self.dropped = 0
        self.sent = 0

    def wait_connected(self, timeout_ms: int) -> bool:

        return True

    def emit(self, event: p.BackendEvent) -> bool:
        self.events.append(event)
        return True

    def close(self, goodbye: p.Goodbye | None = None, *, linger_ms: int = 200) -> None:
        if goodbye is not None:
            self.events.append(goodbye)


def _true_waits(p_: int, m: int, stage: int) -> dict[str, int]:
    """How long ``stage`` waits before each action (and at the tail), per the 1F1B simulation."""
    timeline = simulate(one_f_one_b(p_, m), Durations.uniform(p_, T_F / 1e9, T_B / 1e9))
    return {
        tail_key(0) if w.before is None else str(w.before): round(w.duration * 1e9) for w in bubbles(timeline)[stage]
    }


class FakeEngine:
    """Executes schedules like DeepSpeed's PipelineEngine; instructions advance the clock."""

    def __init__(self, clock: Clock, *, stage: int, stages: int, micro_batches: int) -> None:
        self.clock = clock
        self.global_rank = self.stage_id = self.local_rank = stage
        self.num_stages = stages
        self.micro_batches = micro_batches
        self.device = torch.device("cpu")
        self.global_steps = 0
        self.waits = _true_waits(stages, micro_batches, stage)
        self.truth: list[str] = []
        """DeepSpeed's own micro-batch numbering of every receive, as keys."""
        self.computed: list[str] = []
        """Forward and backward passes in execution order, numbered by DeepSpeed."""
        self.sends: list[int] = []
        """Passes done before each send."""
        self.send_grad_ns = 0
        """How long each gradient send blocks (gloo hands large tensors over only to a posted receive)."""
        self._now_mb = (0, True)

    def gradient_clipping(self) -> float:
        return 1.0

    def train_batch(self) -> None:
        sched = ds_schedule.TrainSchedule(
            micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id
        )
        self._exec_schedule(sched)
        self._aggregate_total_loss()

    def _exec_schedule(self, sched: Any) -> None:
        train = isinstance(sched, ds_schedule.TrainSchedule)
        for step_id, cmds in enumerate(sched):
            if train:
                self._now_mb = _compat.step_to_micro_batch(sched, step_id)
            for cmd in cmds:
                MethodType(self._INSTRUCTION_MAP[type(cmd)], self)(**cmd.kwargs)

    def _aggregate_total_loss(self) -> None:
        self.clock.advance(LOSS_NS)

    def _compute(self, kind: str) -> None:
        self.computed.append(str(Action(self.stage_id, "F" if kind == "F" else "B", self._now_mb[0])))
        self.clock.advance(T_F if kind == "F" else T_B)

    def _send_grad(self) -> None:
        self.sends.append(len(self.computed))
        self.clock.advance(self.send_grad_ns)

    def _recv(self, kind: str) -> None:
        mb, _ = self._now_mb
        key = str(Action(self.stage_id, "F" if kind == "F" else "B", mb))
        self.truth.append(key)
        self.clock.advance(self.waits.get(key, 0))

    def _optimizer_step(self) -> None:
        deepspeed.comm.all_reduce(torch.zeros(1))  # gradient norm over the pipe group: the tail
        deepspeed.comm.all_reduce(torch.zeros(1))  # over the data-parallel group: no wait
        self.global_steps += 1

    _INSTRUCTION_MAP: ClassVar[dict[type[Any], Callable[..., None]]] = {
        ds_schedule.ForwardPass: lambda self, buffer_id: self._compute("F"),
        ds_schedule.BackwardPass: lambda self, buffer_id: self._compute("B"),
        ds_schedule.RecvActivation: lambda self, buffer_id: self._recv("F"),
        ds_schedule.RecvGrad: lambda self, buffer_id: self._recv("B"),
        ds_schedule.SendActivation: lambda self, buffer_id: self.sends.append(len(self.computed)),
        ds_schedule.SendGrad: lambda self, buffer_id: self._send_grad(),
        ds_schedule.LoadMicroBatch: lambda self, buffer_id: None,
        ds_schedule.ReduceGrads: lambda self: None,
        ds_schedule.ReduceTiedGrads: lambda self: None,
        ds_schedule.OptimizerStep: lambda self: self._optimizer_step(),
    }


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(session_mod, "time", types.SimpleNamespace(monotonic_ns=clock.monotonic_ns))
    return clock


def _run(
    clock: Clock,
    monkeypatch: pytest.MonkeyPatch,
    *,
    stage: int,
    stages: int = 2,
    m: int = 4,
    steps: int = 5,
    close: bool = True,
    send_grad_ns: int = 0,
) -> tuple[FakeEngine, DeepSpeedAdapter, Recorder]:
    engine = FakeEngine(clock, stage=stage, stages=stages, micro_batches=m)
    engine.send_grad_ns = send_grad_ns

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        # the first all-reduce of a step (the gradient norm) waits for the slowest stage
        first = engine.__dict__.setdefault("_reduced", set())
        if engine.global_steps not in first:
            first.add(engine.global_steps)
            clock.advance(engine.waits.get(tail_key(0), 0))

    monkeypatch.setattr(deepspeed.comm, "all_reduce", all_reduce)
    recorder = Recorder()
    config = BackendConfig(
        endpoint="ipc:///nonexistent",
        rank=stage,
        stage=stage,
        num_stages=stages,
        device=f"cpu:{stage}",
        framework="deepspeed",
    )
    session = BackendSession(config, emitter=cast(EventEmitter, recorder))
    adapter = DeepSpeedAdapter(engine, session=session, mode="profile", profile_dir=None, clock=clock.monotonic_ns)
    original_exec = FakeEngine._exec_schedule
    original_loss = FakeEngine._aggregate_total_loss
    monkeypatch.setattr(engine, "_exec_schedule", lambda sched: adapter.run_schedule(original_exec, engine, sched))
    monkeypatch.setattr(engine, "_aggregate_total_loss", lambda: adapter.run_aggregate_loss(original_loss, engine))
    for _ in range(steps):
        engine.train_batch()
    if close:
        adapter.close()
    return engine, adapter, recorder


def _observations(adapter: DeepSpeedAdapter) -> RankObservations:
    assert adapter.log is not None
    return adapter.log.observations()


@pytest.mark.parametrize(("stages", "m"), [(2, 4), (3, 5), (4, 4), (4, 7)])
def test_waits_are_keyed_by_deepspeeds_own_micro_batch(
    clock: Clock, monkeypatch: pytest.MonkeyPatch, stages: int, m: int
) -> None:
    for stage in range(stages):
        engine, adapter, _ = _run(clock, monkeypatch, stage=stage, stages=stages, m=m, steps=2)
        assert adapter.tracker.last_step is not None
        waits = adapter.tracker.last_step.waits
        recv_keys = [w.key for w in waits if not w.key.startswith(("tail:", "send:"))]
        assert recv_keys == engine.truth[len(engine.truth) // 2 :]
        # DeepSpeed runs the passes in the 1F1B order the adapter numbers sends by
        passes = engine.computed[len(engine.computed) // 2 :]
        assert passes == [str(a) for a in one_f_one_b(stages, m).actions[stage]]
        sends = [i - 2 * m for i in engine.sends[len(engine.sends) // 2 :]]  # passes done this step
        send_keys = [w.key for w in waits if w.key.startswith("send:")]
        assert send_keys == [f"send:{passes[i]}" if i < len(passes) else "send:tail" for i in sends]
        assert [w.key for w in adapter.tracker.last_step.waits if w.key.startswith("tail:")] == [
            tail_key(0),
            tail_key(1),
            TAIL_LOSS,
        ]


@pytest.mark.parametrize("stage", [0, 1])
def test_bubbles_follow_the_schedule_then_the_measurements(
    clock: Clock, monkeypatch: pytest.MonkeyPatch, stage: int
) -> None:
    engine, adapter, recorder = _run(clock, monkeypatch, stage=stage, steps=5)
    started = [e for e in recorder.events if isinstance(e, p.BubbleStarted)]
    ended = [e for e in recorder.events if isinstance(e, p.BubbleEnded)]
    finished = [e for e in recorder.events if isinstance(e, p.StepFinished)]

    # step 0: nothing measured yet, nothing announced; every step reports its end
    assert [e.step for e in finished] == [0, 1, 2, 3, 4]
    assert {e.step for e in started} == {1, 2, 3, 4}
    # from step 1, exactly the schedule's bubbles, with the schedule's length and then the measured one
    true_waits = sorted(engine.waits.values())
    for step in range(1, 5):
        expected = sorted(e.expected_ns for e in started if e.step == step)
        measured = sorted(e.duration_ns for e in ended if e.step == step)
        assert expected == true_waits
        assert measured == true_waits
        (done,) = (e for e in finished if e.step == step)
        assert done.bubble_ns == sum(true_waits)
    assert [e.index for e in started if e.step == 2] == list(range(len(true_waits)))
    assert all(e.device == f"cpu:{stage}" and e.stage == stage for e in started)
    assert isinstance(recorder.events[-1], p.Goodbye)

    # the profile puts each bubble where the schedule has it
    profile = build_profile([_observations(adapter)]).stages[0]
    timeline = simulate(one_f_one_b(2, 4), Durations.uniform(2, T_F / 1e9, T_B / 1e9))
    windows = bubbles(timeline)[stage]
    assert [b.key for b in profile.bubbles] == [tail_key(0) if w.before is None else str(w.before) for w in windows]
    assert [b.offset_ns for b in profile.bubbles] == [round(w.start * 1e9) for w in windows]
    assert profile.forward_ns == T_F and profile.backward_ns == T_B


def test_blocking_sends_become_bubbles_once_measured(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    _, adapter, recorder = _run(clock, monkeypatch, stage=1, steps=4, send_grad_ns=5 * MS)
    assert adapter.tracker.last_step is not None
    send_waits = [w for w in adapter.tracker.last_step.waits if w.key.startswith("send:")]
    assert len(send_waits) == 4 and all(w.duration_ns == 5 * MS for w in send_waits)  # one per micro-batch
    started = [e for e in recorder.events if isinstance(e, p.BubbleStarted)]
    # measured from step 1 on (step 0 is warm-up), announced from step 2 on
    assert [e.expected_ns for e in started if e.step == 1].count(5 * MS) == 0
    for step in (2, 3):
        assert [e.expected_ns for e in started if e.step == step].count(5 * MS) == len(send_waits)


def test_stage_keys_match_the_pipeline_position(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    _, first, _ = _run(clock, monkeypatch, stage=0, steps=3)
    _, last, _ = _run(clock, monkeypatch, stage=1, steps=3)
    first_keys = [b.key for b in build_profile([_observations(first)]).stages[0].bubbles]
    last_keys = [b.key for b in build_profile([_observations(last)]).stages[0].bubbles]
    assert first_keys == ["0B0", "0B3"]  # fill gap and cool-down: stage 0 idles late
    assert last_keys == ["1F0", tail_key(0)]  # head and tail: the last stage idles at the ends


def test_untimed_when_not_training_or_closed(clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, adapter, recorder = _run(clock, monkeypatch, stage=1, steps=3, close=False)
    assert "_INSTRUCTION_MAP" in engine.__dict__
    before, last = len(recorder.events), adapter.tracker.last_step
    engine._exec_schedule(ds_schedule.InferenceSchedule(micro_batches=4, stages=2, stage_id=1))
    assert len(recorder.events) == before  # evaluation batches are not training steps
    assert adapter.tracker.last_step is last and adapter.tracker.steps_done == 3

    adapter.close()
    assert "_INSTRUCTION_MAP" not in engine.__dict__  # the per-instance table is gone
    after_close = len(recorder.events)
    engine.train_batch()
    assert len(recorder.events) == after_close
    assert adapter.tracker.steps_done == 3


def test_patch_is_idempotent_and_reversible() -> None:
    class Engine:
        _INSTRUCTION_MAP: ClassVar[dict[type[Any], Any]] = {}

        def _exec_schedule(self, sched: Any) -> str:
            return "exec"

        def _aggregate_total_loss(self) -> str:
            return "loss"

    module = types.ModuleType("fake_engine_module")
    module.PipelineEngine = Engine  # type: ignore[attr-defined]
    wraps: list[str] = []

    def wrap_exec(fn: _compat.ExecSchedule) -> _compat.ExecSchedule:
        wraps.append("exec")
        return lambda engine, sched: "wrapped-" + fn(engine, sched)

    def wrap_loss(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return lambda engine: "wrapped-" + fn(engine)

    assert _compat.patch_pipeline_engine(module, exec_schedule=wrap_exec, aggregate_loss=wrap_loss)
    assert _compat.patch_pipeline_engine(module, exec_schedule=wrap_exec, aggregate_loss=wrap_loss)
    assert wraps == ["exec"]
    assert Engine()._exec_schedule(None) == "wrapped-exec"
    assert Engine()._aggregate_total_loss() == "wrapped-loss"
    _compat.unpatch_pipeline_engine(module)
    assert Engine()._exec_schedule(None) == "exec"
    assert not _compat.is_patched(module)

    broken = types.ModuleType("broken")
    broken.PipelineEngine = type("PipelineEngine", (), {})  # type: ignore[attr-defined]
    assert not _compat.patch_pipeline_engine(broken, exec_schedule=wrap_exec, aggregate_loss=wrap_loss)


def test_attach_refuses_what_is_not_a_pipeline_engine() -> None:
    from freeride.backends.deepspeed import attach, attached

    with pytest.raises(TypeError, match="PipelineEngine"):
        attach(object())
    assert attached(object()) is None


def test_device_names_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from freeride.backends.deepspeed._device import device_name
    from freeride.backends.memory import device_memory

    facts = _compat.EngineFacts(
        rank=3,
        stage=1,
        num_stages=2,
        micro_batches=4,
        gradient_clipping=1.0,
        device_type="cpu",
        device_index=0,
        local_rank=3,
    )
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert device_name(facts) == "cpu:5"  # the core the rank is pinned to
    assert device_name(dataclasses.replace(facts, device_type="cuda")) == "cuda:0"

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    spare_one, total_one = device_memory("cpu", 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    _, total_four = device_memory("cpu", 0)
    assert 0 < spare_one <= total_one
    assert total_four == total_one // 4  # the node's memory is shared by its local ranks
