"""The torchpipe backend without processes: translating torch's actions, keying waits, staying harmless."""

from __future__ import annotations

import logging
import re
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from freeride.backends.schedule import Action, interleaved, one_f_one_b
from freeride.backends.torchpipe import _compat
from freeride.backends.torchpipe.adapter import TorchPipeAdapter
from freeride.backends.torchpipe.translate import loop_placed, to_schedule
from freeride.backends.tracker import StepPlan, StepTracker


class _Sink:
    """Stands in for a BackendSession."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(endpoint="ipc:///nonexistent/events")
        self.sent = 0
        self.started: list[int] = []
        self.steps: list[int] = []

    def bubble_started(self, step: int, expected_ns: int, *, spare_memory: int | None = None) -> bool:
        self.started.append(expected_ns)
        return True

    def bubble_ended(self) -> int:
        return 0

    def step_finished(self, step: int, duration_ns: int) -> None:
        self.steps.append(step)

    def heartbeat(self) -> None:
        pass

    def close(self) -> None:
        pass


class Schedule1F1B(SimpleNamespace):
    """Named as torch's class: the adapter reads the name."""


def irecv() -> None: ...


def isend() -> None: ...


def _schedule(stage: int, *, training: bool = True) -> Schedule1F1B:
    return Schedule1F1B(
        _stage=SimpleNamespace(num_stages=2, stage_index=stage, device=SimpleNamespace(type="cpu", index=None)),
        _n_microbatches=2,
        _has_backward=training,
        pipeline_order=None,
    )


_kept: list[Schedule1F1B] = []
"""The schedules of the tests' adapters (an adapter holds its schedule weakly)."""


def _adapter(stage: int) -> tuple[TorchPipeAdapter, _Sink]:
    sink = _Sink()
    _kept.append(_schedule(stage))
    adapter = TorchPipeAdapter(_kept[-1], session=sink, mode="emit")  # type: ignore[arg-type]
    return adapter, sink


# ------------------------------------------------------------------ translate


def test_torch_actions_translate_to_ours() -> None:
    rows = {
        0: [(0, "UNSHARD", -1), (0, "F", 0), (0, "SEND_F", 0), (0, "RECV_B", 0), (0, "I", 0), (0, "W", 0)],
        1: [(1, "RECV_F", 0), (1, "F", 0), (1, "B", 0), (1, "REDUCE_GRAD", -1)],
    }
    schedule = to_schedule("ZBish", rows, stage_to_rank={0: 0, 1: 1}, num_ranks=2, num_microbatches=1)
    assert [str(a) for a in schedule.actions[0]] == ["0F0", "0B0", "0W0"]  # torch's I is our B
    assert [str(a) for a in schedule.actions[1]] == ["1F0", "1B0"]


def test_a_ranks_stages_become_its_chunks_in_order() -> None:
    rows = {
        0: [(0, "F", 0), (3, "F", 0), (3, "B", 0), (0, "B", 0)],
        1: [(1, "F", 0), (2, "F", 0), (2, "B", 0), (1, "B", 0)],
    }
    v_shape = {0: 0, 1: 1, 2: 1, 3: 0}
    schedule = to_schedule("ZBV", rows, stage_to_rank=v_shape, num_ranks=2, num_microbatches=1)
    assert schedule.num_chunks == 2
    assert schedule.actions[0][1] == Action(0, "F", 0, 1)
    assert not loop_placed(v_shape, 2)
    assert loop_placed({0: 0, 1: 1, 2: 0, 3: 1}, 2)


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ({0: [(0, "F", 0), (0, "X", 0)], 1: []}, "unknown torch action type 'X'"),
        ({0: [(1, "F", 0)], 1: []}, "a stage it does not hold"),
        ({0: [(0, "F", 0)]}, "rows must list ranks 0..1"),
    ],
)
def test_bad_action_lists_are_rejected(rows: dict[int, list[tuple[int, str, int]]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        to_schedule("bad", rows, stage_to_rank={0: 0, 1: 1}, num_ranks=2, num_microbatches=1)


def test_interleaved_order_round_trips_through_torch_notation() -> None:
    ours = interleaved(2, 4, 2)
    letters = {"F": "F", "B": "B"}
    rows = {
        r: [(a.chunk * 2 + a.stage, letters[a.kind], a.microbatch) for a in row] for r, row in enumerate(ours.actions)
    }
    back = to_schedule(ours.name, rows, stage_to_rank={s: s % 2 for s in range(4)}, num_ranks=2, num_microbatches=4)
    assert back.actions == ours.actions


# --------------------------------------------------------------------- compat


def test_a_torch_without_the_hooked_names_is_refused_by_name() -> None:
    schedules, stage = ModuleType("schedules"), ModuleType("stage")
    with pytest.raises(RuntimeError, match=r"lacks \['schedules.PipelineScheduleSingle'.*stage._PipelineStageBase"):
        _compat.patch(
            schedules,
            stage,
            step=lambda f: f,
            batch_p2p=lambda f: f,
            wait_batch_p2p=lambda f: f,
            compute=lambda k, f: f,
        )


@pytest.mark.parametrize("version", ["2.10.0", "2.12.1+cpu", "1.13.1"])
def test_a_torch_older_than_every_checked_release_is_refused(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    """Older releases have the hooked names but other action lists: the backend stays out, saying why."""
    import torch.distributed.pipelining.schedules as schedules
    import torch.distributed.pipelining.stage as stage

    monkeypatch.setattr(_compat, "torch_version", lambda: version)
    wrapped: list[str] = []
    with pytest.raises(RuntimeError, match=rf"torch {re.escape(version)} is older than 2\.13.*without FreeRide"):
        _compat.patch(
            schedules,
            stage,
            step=lambda f: wrapped.append("step") or f,
            batch_p2p=lambda f: f,
            wait_batch_p2p=lambda f: f,
            compute=lambda k, f: f,
        )
    assert wrapped == [] and not _compat.is_patched(schedules)


def test_releases_compare_by_major_and_minor() -> None:
    assert _compat.release("2.13.0+cpu") == (2, 13)
    assert _compat.release("2.9.1") < _compat.release("2.13") < _compat.release("3.0.0a0")
    assert _compat.release("unknown") == (0, 0)


def test_on_import_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    from freeride.backends.torchpipe import on_import

    with caplog.at_level(logging.WARNING):
        on_import(ModuleType("not_torch_schedules"))
    assert "training continues without FreeRide" in caplog.text
    assert "lacks ['schedules.PipelineScheduleSingle'" in caplog.text and "Traceback" not in caplog.text


# -------------------------------------------------------------------- adapter


def _run_rank1_step(adapter: TorchPipeAdapter) -> None:
    """What Schedule1F1B runs on the last of 2 ranks, 2 micro-batches:
    recv F0, F0, B0, send+recv F1, F1, B1, send, reduce the gradients."""
    recv, send = [SimpleNamespace(op=irecv)], [SimpleNamespace(op=isend)]

    def wait(ops: list[Any]) -> None:
        works = [object()]
        adapter.posted(ops, works)
        adapter.wait(lambda w: None, works)

    def body(schedule: Any) -> str:
        wait(recv)
        adapter.compute("F", lambda: None, (), {})
        adapter.compute("B", lambda: None, (), {})
        wait(send + recv)
        adapter.compute("F", lambda: None, (), {})
        adapter.compute("B", lambda: None, (), {})
        wait(send)
        adapter.sync(lambda: None, (), {})
        return "loss"

    assert adapter.run_step(body, adapter._schedule(), (), {}) == "loss"


def test_waits_are_keyed_by_the_action_they_feed() -> None:
    adapter, sink = _adapter(1)
    assert adapter.plan is not None and adapter.plan.schedule == one_f_one_b(2, 2)
    _run_rank1_step(adapter)
    record = adapter.tracker.last_step
    assert record is not None
    assert [w.key for w in record.waits] == ["1F0", "1F1", "send:tail", "tail:reduce_grad"]
    assert sink.steps == [0]


def test_eval_steps_are_not_tracked() -> None:
    sink = _Sink()
    schedule = _schedule(0, training=False)
    adapter = TorchPipeAdapter(schedule, session=sink, mode="emit")  # type: ignore[arg-type]
    assert adapter.run_step(lambda s: 1, schedule, (), {}) == 1
    assert sink.steps == [] and adapter.tracker.steps == 0


def test_bookkeeping_errors_are_counted_not_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    adapter, _ = _adapter(1)

    def broken(*args: Any) -> None:
        raise KeyError("ours")

    for name in ("wait_started", "wait_ended", "action_started"):
        monkeypatch.setattr(adapter.tracker, name, broken)
    _run_rank1_step(adapter)
    assert adapter.errors == 12  # 4 waits (with the sync) begun and ended, 4 passes: training went on through each


def test_the_frameworks_errors_pass_through_and_abandon_the_step() -> None:
    adapter, sink = _adapter(1)

    def failing(schedule: Any) -> None:
        raise ValueError("torch's")

    with pytest.raises(ValueError, match="torch's"):
        adapter.run_step(failing, adapter._schedule(), (), {})
    assert not adapter.tracker.in_step and sink.steps == []


def test_an_unsimulated_plan_has_no_priors() -> None:
    """V-shaped placements: the simulator would follow the wrong neighbours, so nothing is predicted unmeasured."""
    schedule = one_f_one_b(2, 2)
    for simulated, expect_prior in ((True, True), (False, False)):
        tracker = StepTracker(_Sink())
        plan = StepPlan(schedule=schedule, stage=1, merge_tail=True, simulated=simulated)
        tracker.record_compute("F", 10_000_000)
        tracker.record_compute("B", 20_000_000)
        tracker.begin_step(plan)
        tracker.wait_started()
        tracker.wait_ended()
        waits = tracker.end_step()
        assert waits is not None
        assert (waits.waits[0].expected_ns > 0) is expect_prior, (simulated, waits.waits)


# ------------------------------------------------------- torch's own loops


class _RecordingStage:
    """The parts of a pipeline stage that torch's single-stage loops call; records the passes."""

    def __init__(self, stage: int) -> None:
        self.stage_index = stage
        self.passes: list[str] = []

    def get_fwd_recv_ops(self, mb: int) -> list[Any]:
        return []

    get_bwd_recv_ops = get_fwd_send_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self.passes.append(f"{self.stage_index}F{mb}")

    def backward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self.passes.append(f"{self.stage_index}B{mb}")

    def perform_reduce_grad(self, scale: int) -> None:
        pass


@pytest.mark.parametrize("name", ["Schedule1F1B", "ScheduleGPipe"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (3, 5)])
def test_torchs_single_stage_loops_run_the_orders_the_plan_assumes(name: str, p: int, m: int) -> None:
    """SINGLE_STAGE_ORDERS stands in for torch's pipeline_order, which misnumbers 1F1B's micro-batches."""
    from torch.distributed.pipelining import schedules

    from freeride.backends.torchpipe.adapter import SINGLE_STAGE_ORDERS

    for stage in range(p):
        loop = object.__new__(getattr(schedules, name))
        recorder = _RecordingStage(stage)
        loop.__dict__.update(_stage=recorder, _n_microbatches=m, _num_stages=p, scale_grads=True)
        loop._check_inputs = lambda *a: ([()] * m, [{}] * m)
        loop._initialize_stage = lambda *a: None
        loop._maybe_compute_loss = lambda *a: None
        loop._maybe_get_loss = lambda *a: None
        loop._update_losses = lambda *a: None
        loop._step_microbatches([()] * m, [{}] * m, None, None)
        assert recorder.passes == [str(a) for a in SINGLE_STAGE_ORDERS[name](p, m).actions[stage]], (stage, name)
