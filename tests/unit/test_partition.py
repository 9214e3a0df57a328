"""Partitioned training and inference give the numbers of plain steps, and restore exactly at any step boundary."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _torchfix import deterministic_one_thread  # noqa: F401 - autouse fixture
from torch import nn

from freeride.partition import (
    DEFAULT_TARGET_MS,
    InferenceParts,
    PartitionedInference,
    PartitionedTraining,
    TrainingParts,
    piece_target_s,
)
from freeride.partition import plan as plan_module
from freeride.partition import update as update_module
from freeride.partition.plan import group
from freeride.sidetask import TaskContext
from freeride.worker.checkpoint import load_checkpoint

Batches = list[tuple[torch.Tensor, torch.Tensor]]


# -- three models: a MobileNet-like CNN, a causal transformer LM, and a forward that is no chain of children


class _InvertedResidual(nn.Module):
    def __init__(self, c: int, expand: int) -> None:
        super().__init__()
        hidden = c * expand
        self.block = nn.Sequential(
            nn.Conv2d(c, hidden, 1, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
            nn.Conv2d(hidden, c, 1, bias=False),
            nn.BatchNorm2d(c),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        out += x  # in place on the block's output: a boundary there must not hand out a leaf
        return out


class MobileNetLike(nn.Module):
    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(_InvertedResidual(16, 4), _InvertedResidual(16, 4))
        self.head = nn.Sequential(nn.Conv2d(16, 64, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.head(self.blocks(self.stem(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 48, d: int = 32, context: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(context, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.lm_head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.lm_head(self.encoder(h, mask=self.mask, is_causal=True))


class SkipNet(nn.Module):
    """Branches, a concatenation and functional calls: no chain of children. Its wide layers get split."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 24, 3, padding=1)
        self.conv2 = nn.Conv2d(24, 24, 3, padding=1)
        self.wide = nn.Linear(24 * 16, 256)
        self.narrow = nn.Linear(24 * 16, 32)
        self.out = nn.Linear(256 + 32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.relu(self.conv(x))
        b = torch.tanh(self.conv2(a)) + a
        flat = F.max_pool2d(b, 2).flatten(1)
        h = torch.cat([F.gelu(self.wide(flat)), self.narrow(flat) * flat.mean(1, keepdim=True)], dim=1)
        return self.out(h)


def _images(n: int, size: int = 4, side: int = 8) -> Batches:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 3, side, side, generator=g), torch.randint(5, (size,), generator=g)) for _ in range(n)]


def _tokens(n: int, size: int = 3, context: int = 12, vocab: int = 48) -> Batches:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        t = torch.randint(vocab, (size, context + 1), generator=g)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[nn.Module], torch.optim.Optimizer], Any, Batches]] = {
    "mobilenet-sgd": (
        MobileNetLike,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3),
        F.cross_entropy,
        _images(4),
    ),
    # SGD: the attention's key bias has a gradient of exactly zero in theory (softmax ignores a shift), so
    # its computed gradient is rounding noise, which Adam would scale up into full-size steps
    "lm-sgd": (
        TinyLM,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4),
        _lm_loss,
        _tokens(4),
    ),
    # Adam divides by sqrt(v) + eps: with the default eps a gradient of a few ulps (rounding alone) becomes a
    # full step of lr; eps=1e-3 keeps a rounding difference a rounding difference
    "skipnet-adam": (
        SkipNet,
        lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, eps=1e-3),
        F.cross_entropy,
        _images(3),
    ),
}


class _Task(PartitionedTraining):
    def __init__(self, case: str, *, target_ms: float = 0.05, steps: int = 0) -> None:
        super().__init__(target_ms=target_ms, steps=steps, profile_runs=1)
        self.case = case

    def build(self) -> TrainingParts:
        make, optimizer, loss_fn, batches = CASES[self.case]
        torch.manual_seed(0)
        model = make()
        return TrainingParts(model, optimizer(model), loss_fn, batches)


def _ctx() -> TaskContext:
    return TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=Path("."))


def _plain(case: str, batches: int) -> nn.Module:
    make, optimizer, loss_fn, data = CASES[case]
    torch.manual_seed(0)
    model = make()
    opt = optimizer(model)
    torch.manual_seed(7)
    for x, y in data[:batches]:
        model.train()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return model


def _started(case: str, **kw: Any) -> _Task:
    task = _Task(case, **kw)
    asyncio.run(task.setup(_ctx()))
    torch.manual_seed(7)  # the random stream (dropout) the plain run also starts from
    return task


def _run_batches(task: _Task, batches: int) -> int:
    steps = 0
    while task.batches_done < batches:
        task.step()
        steps += 1
    return steps


def _assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_partitioned_steps_give_the_plain_result(case: str) -> None:
    task = _started(case)
    plan = task.plan
    assert plan is not None and len(plan.forward) > 3 and len(plan.backward) > 3 and len(task.chunks) > 1
    _run_batches(task, 3)
    _assert_same(_plain(case, 3), task.model)


def test_slow_children_are_opened_and_wide_layers_split() -> None:
    # a target far below any layer's time, so that whether they are opened does not depend on this machine
    lm = _started("lm-sgd", target_ms=0.005).plan
    assert lm is not None
    called = {str(n.target) for n in lm.graph.nodes if n.op == "call_module"}
    # the encoder and its layers were traced into: attention and the feed-forward layers are pieces of their own
    assert "encoder.layers.0.self_attn" in called and "encoder.layers.1.linear2" in called
    skip = _started("skipnet-adam", target_ms=0.005).plan
    assert skip is not None
    sliced = {str(skip.graph.nodes[a.start].target) for a in skip.atoms if a.is_slice}
    assert {"wide", "conv2"} <= sliced


def test_a_sliced_layers_gradient_keeps_its_storage_from_batch_to_batch() -> None:
    # fresh storage each batch costs its pages again on CPU (a page fault per 4 KB written)
    task = _started("skipnet-adam", target_ms=0.005)
    weight = task.model.get_submodule("wide").weight
    grads: dict[int, torch.Tensor] = {}  # held, so that a freed gradient's memory could not come back by chance
    while task.batches_done < 3:
        if task.step_kind().startswith("u") and weight.grad is not None:
            grads.setdefault(task.batches_done, weight.grad)
        task.step()
    assert sorted(grads) == [0, 1, 2] and len({g.data_ptr() for g in grads.values()}) == 1
    assert weight.grad is None  # between batches, as after plain training's zero_grad(set_to_none=True)
    _assert_same(_plain("skipnet-adam", 3), task.model)


def test_kinds_name_the_pieces_and_each_has_a_cost() -> None:
    task = _started("mobilenet-sgd")
    kinds = []
    while task.batches_done < 1:
        kinds.append(task.step_kind())
        task.step()
    updates = [k for k in kinds if k.startswith("u")]
    assert kinds[0].startswith("f0-") and any(k.startswith("b") for k in kinds) and kinds[-len(updates) :] == updates
    assert updates[0].startswith("u0-") and updates[-1].endswith(f"-{task.update.rows}")  # the rows they update
    assert len(set(kinds)) == len(kinds)  # one batch: each piece once
    assert all((cost := task.step_cost(k)) is not None and cost > 0 for k in kinds)
    assert task.step_cost("nope") is None


@pytest.mark.parametrize("case", sorted(CASES))
def test_steps_run_in_halves_where_the_whole_does_not_fit_give_the_plain_result(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a fixed timer (each reading 0.1 ms after the last): steps of two atoms under the 0.2 ms target on any
    # machine; measured, a slow or busy machine's atoms each exceed it and no step has two to halve
    monkeypatch.setattr(plan_module, "timer", lambda device: itertools.count(0.0, 1e-4).__next__)
    task = _started(case, target_ms=0.2)
    # the kinds below are the plan's: a regroup on measured drift (this machine's speed) would rename them
    monkeypatch.setattr(task, "_maybe_regroup", lambda: None)
    # every whole step takes 10 ms, every half 4 ms; 5 ms of room: halves wherever a step has two atoms
    assert task.plan is not None
    whole = {s.kind for s in (*task.plan.forward, *task.plan.backward)}
    estimate = lambda kind: 10_000_000 if kind in whole else 4_000_000  # noqa: E731
    kinds: list[str] = []
    halved = 0
    rest: str | None = None
    while task.batches_done < 3:
        current = task._current()  # the step the pieces come from
        chosen = task.fit_piece(5_000_000, estimate)
        kind = task.step_kind()
        assert chosen is None or chosen == kind  # what it chose is what runs next
        if current is not None and len(current.atoms) > 1:
            head, tail = task._halves(current, task._phase)
            assert kind in (head.kind, tail.kind) and kind != current.kind  # never the whole
            assert kind[0] == current.kind[0] and {head.kind, tail.kind}.isdisjoint(whole)
            if kind == head.kind:
                halved += 1
                assert rest is None
                rest = tail.kind
            else:
                assert rest == kind  # the rest runs next
                rest = None
        assert (cost := task.step_cost(kind)) is not None and cost >= 0  # as planned now (a regroup renames)
        kinds.append(kind)
        task.step()
    assert halved >= 3
    _assert_same(_plain(case, 3), task.model)


def test_a_step_that_fits_whole_runs_whole_even_after_its_half_was_chosen() -> None:
    task = _started("mobilenet-sgd", target_ms=0.2)
    while (current := task._current()) is None or len(current.atoms) < 2:
        task.step()
    kind = task.step_kind()
    head, _ = task._halves(current, task._phase)
    assert task.fit_piece(1, lambda k: 1_000) is None  # 1 ns of room: not even a half fits
    assert task.fit_piece(1_000, lambda k: 2_000 if k == kind else 1_000) == head.kind != kind
    assert task.step_kind() == head.kind
    assert task.fit_piece(10_000, lambda k: 2_000) == kind  # a later bubble with room for the whole
    assert task.step_kind() == kind


@pytest.mark.parametrize("case", ["mobilenet-sgd", "lm-sgd"])
@pytest.mark.parametrize("where", ["forward", "backward", "update"])
def test_a_checkpoint_mid_batch_restores_exactly(case: str, where: str, tmp_path: Path) -> None:
    # batch 0 whole, then stop inside batch 1 in the given phase
    task = _started(case)
    _run_batches(task, 1)
    while not task.step_kind().startswith(where[0]):
        task.step()
    task.step()
    if where != "update":
        assert task.step_kind().startswith(where[0])  # still in the middle of that phase
    path = tmp_path / "ckpt.pt"
    torch.save({"steps": 0, "state": task.state_dict()}, path)

    # the worker's order: the checkpoint is handed over before setup, and loaded with weights only
    restored = _Task(case)
    restored.load_state_dict(load_checkpoint(path)["state"])
    asyncio.run(restored.setup(_ctx()))
    assert restored.batches_done == 1
    _run_batches(restored, 3)
    _assert_same(_plain(case, 3), restored.model)


def test_a_checkpoint_loaded_after_setup_restores_too() -> None:
    task = _started("mobilenet-sgd")
    task.step()
    task.step()
    state = task.state_dict()
    other = _started("mobilenet-sgd")
    _run_batches(other, 1)  # a different position, overwritten by the load
    other.load_state_dict(state)
    _run_batches(other, 2)
    _assert_same(_plain("mobilenet-sgd", 2), other.model)


def test_group_keeps_steps_under_the_target_and_regroups_on_drift(monkeypatch: pytest.MonkeyPatch) -> None:
    # a fixed timer (each reading 1 ms after the last: every atom costs the target): how many pieces a
    # measured pass gives under a 1 ms target is the machine's speed, not the rule this test checks
    monkeypatch.setattr(plan_module, "timer", lambda device: itertools.count(0.0, 1e-3).__next__)
    name = lambda run: "-".join(map(str, run))  # noqa: E731
    steps = group([1.0, 1.0, 1.0, 3.0, 0.5, 0.5], 2.0, name)
    assert [s.atoms for s in steps] == [(0, 1), (2,), (3,), (4, 5)] and steps[0].kind == "0-1"
    assert [s.atoms for s in group([1.0, 1.0, 1.0], 2.0, name, reverse=True)] == [(2, 1), (0,)]
    plan = _started("mobilenet-sgd", target_ms=1.0).plan
    assert plan is not None
    assert len(plan.forward) > 1
    plan.regroup(1e-6)  # far faster than measured: the whole pass fits in one step
    assert len(plan.forward) == len(plan.backward) == 1
    plan.regroup(1e9)  # far slower: one atom per step
    assert len(plan.forward) == len(plan.atoms)


def test_a_kind_names_the_work_it_runs_in_every_grouping() -> None:
    # step times are kept per kind, within a run and across runs: a kind that meant other work after a
    # regroup handed one piece another's time (a VGG-19 piece kept out of bubbles by a 43 ms estimate)
    plan = _started("mobilenet-sgd", target_ms=0.2).plan
    assert plan is not None and len(plan.atoms) > 2
    seen: dict[str, frozenset[int]] = {}
    for scale in (1.0, 1e9, 1e-15, 1e6):  # scales multiply: one atom a step, one step a pass, as measured
        plan.regroup(scale)
        for phase, steps in (("f", plan.forward), ("b", plan.backward)):
            for step in steps:
                assert step.kind.startswith(phase) and step.kind == plan.kind(phase, step.atoms)
                assert seen.setdefault(step.kind, frozenset(step.atoms)) == frozenset(step.atoms)
    forward = {frozenset(s.atoms) for s in plan.forward}
    assert len({k for k in seen if k.startswith("f")}) > len(forward)  # the groupings differed


def test_two_plans_of_the_same_model_name_their_steps_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    # what an estimates file carries from one run to the next; the timer fixed, so that both plans agree
    monkeypatch.setattr(plan_module, "timer", lambda device: itertools.count(0.0, 1e-4).__next__)
    one, two = _started("mobilenet-sgd", target_ms=0.2).plan, _started("mobilenet-sgd", target_ms=0.2).plan
    assert one is not None and two is not None and one is not two
    kinds = [s.kind for s in (*one.forward, *one.backward)]
    assert len(set(kinds)) == len(kinds) > 4 and kinds == [s.kind for s in (*two.forward, *two.backward)]
    lm = _started("lm-sgd", target_ms=0.2).plan
    assert lm is not None and not set(kinds) & {s.kind for s in (*lm.forward, *lm.backward)}


def test_a_kinds_first_run_does_not_move_the_drift_that_regroups() -> None:
    task = _started("mobilenet-sgd")
    assert task.plan is not None
    step = task.plan.forward[-1]
    task._ran.discard(step.kind)
    task._observe(step, 10 * step.cost_s)  # its first run in this process: one-time costs
    assert task._drift == 1.0
    task._observe(step, 10 * step.cost_s)
    assert task._drift > 1.0


class _Infer(PartitionedInference):
    def __init__(self, *, target_ms: float = 0.05) -> None:
        super().__init__(target_ms=target_ms, profile_runs=1)
        self.outputs: list[torch.Tensor] = []

    def build(self) -> InferenceParts:
        torch.manual_seed(0)
        return InferenceParts(TinyLM(), [x for x, _ in _tokens(3)])

    def consume(self, output: Any, batch: Any) -> None:
        self.outputs.append(output)


def test_inference_outputs_equal_the_whole_model() -> None:
    task = _Infer()
    asyncio.run(task.setup(_ctx()))
    assert task.plan is not None and len(task.plan.forward) > 3
    assert task.step_kind().startswith("i0-")
    while task.batches_done < 3:
        task.step()
    model = TinyLM()
    model.load_state_dict(task.model.state_dict())
    model.eval()
    with torch.no_grad():
        for out, x in zip(task.outputs, [x for x, _ in _tokens(3)], strict=True):
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
    assert task.metrics()["batches"] == 3


def test_an_iterator_for_data_is_refused() -> None:
    class Once(_Task):
        def build(self) -> TrainingParts:
            parts = super().build()
            return parts._replace(data=iter(parts.data))

    with pytest.raises(ValueError, match="re-iterable"):
        asyncio.run(Once("mobilenet-sgd").setup(_ctx()))


def test_lbfgs_is_refused() -> None:
    class Whole(_Task):
        def build(self) -> TrainingParts:
            parts = super().build()
            return parts._replace(optimizer=torch.optim.LBFGS(parts.model.parameters()))

    with pytest.raises(ValueError, match="per-parameter optimizer"):
        asyncio.run(Whole("mobilenet-sgd").setup(_ctx()))


def test_the_step_target_follows_the_bubbles_the_device_has() -> None:
    """Longer bubbles, longer steps (sqrt): the end of a bubble loses about half a step, each step a fixed cost."""
    assert piece_target_s(0) == DEFAULT_TARGET_MS / 1e3  # nothing known: the default
    at_20, at_30, at_100 = (piece_target_s(ms * 1_000_000) for ms in (20, 30, 100))
    assert 2e-3 < at_20 < at_30 < 3.5e-3 < 5e-3 < at_100
    assert at_100 / at_30 == pytest.approx((100 / 30) ** 0.5)
    assert piece_target_s(100_000) == 1e-3  # 0.1 ms bubbles: no step shorter than 1 ms
    assert piece_target_s(10**12) == 20e-3  # very long bubbles: no step longer than 20 ms


def test_a_task_without_target_ms_sizes_its_steps_for_the_bubbles_it_is_told_of() -> None:
    def planned(target_ms: float, bubble_ns: int) -> tuple[float, float]:
        task = _Task("mobilenet-sgd", target_ms=target_ms)
        ctx = TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=Path("."), bubble_ns=bubble_ns)
        asyncio.run(task.setup(ctx))
        assert task.plan is not None
        return task.target_s, task.plan.target_s

    assert planned(0, 30_000_000) == (piece_target_s(30_000_000),) * 2
    assert planned(0, 0) == (DEFAULT_TARGET_MS / 1e3,) * 2  # not told: the default
    assert planned(0.05, 30_000_000) == (0.05e-3,) * 2  # a target given wins


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="target_ms"):
        _Task("mobilenet-sgd", target_ms=-1)
    with pytest.raises(ValueError, match="target_ms"):
        _Task("mobilenet-sgd", target_ms=float("inf"))
    with pytest.raises(ValueError, match="steps"):
        _Task("mobilenet-sgd", steps=-1)


@pytest.mark.parametrize("batch", [0, 1])
def test_a_checkpoint_inside_one_parameters_update_restores_exactly(
    batch: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # batch 0: the optimizer has no state yet for the parameter cut in slices; batch 1: it has
    monkeypatch.setattr(update_module, "MIN_SLICE_ELEMENTS", 1024)  # the model is small: slices of its wide layer
    task = _started("skipnet-adam", target_ms=0.001)
    assert any(not piece.whole for piece in task.update.pieces)  # the wide layer's update is cut in rows
    _run_batches(task, batch)
    while task.update.pending() is None:
        task.step()
    path = tmp_path / "ckpt.pt"
    torch.save({"steps": 0, "state": task.state_dict()}, path)

    restored = _Task("skipnet-adam")  # sized anew: its own pieces
    restored.load_state_dict(load_checkpoint(path)["state"])
    asyncio.run(restored.setup(_ctx()))
    _run_batches(restored, 3)
    _assert_same(_plain("skipnet-adam", 3), restored.model)
