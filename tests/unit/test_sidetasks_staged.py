"""SGD split into short steps: same numbers as one step, exact checkpoints at every step boundary."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _torchfix import deterministic_one_thread  # noqa: F401 - autouse fixture
from torch import nn

from freeride.sidetask import IterativeTask, TaskContext, UnboundedGate, run_alone
from sidetasks._staged import StagedSGD, _plan_chunks
from sidetasks.vision import ResNet18Inference, ResNet18Training, ResNet50Training

TINY: dict[str, Any] = {"image_size": 16, "num_classes": 4, "batch_size": 4, "train_size": 64, "seed": 0}


def _small_net(*, batch_norm: bool, dropout: float = 0.3) -> tuple[nn.Module, list[nn.Module]]:
    torch.manual_seed(0)
    first: list[nn.Module] = [nn.Conv2d(3, 8, 3, padding=1)]
    if batch_norm:
        first.append(nn.BatchNorm2d(8))
    segments = [
        nn.Sequential(*first, nn.ReLU(inplace=True)),
        nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(inplace=True), nn.Dropout(dropout)),
        nn.Sequential(nn.Flatten(1), nn.Linear(8 * 8 * 8, 5)),
    ]
    return nn.Sequential(*segments), segments


def _batches(n: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 3, 8, 8, generator=g), torch.randint(5, (size,), generator=g)) for _ in range(n)]


def _reference(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    losses = []
    torch.manual_seed(7)
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _staged(
    model: nn.Module, segments: list[nn.Module], batches: list[tuple[torch.Tensor, torch.Tensor]], **kw: Any
) -> tuple[list[float], list[str]]:
    sgd = StagedSGD(model, segments, lr=0.05, momentum=0.9, weight_decay=1e-3, **kw)
    pending = list(batches)
    losses, kinds = [], []
    torch.manual_seed(7)
    while pending or sgd.in_batch:
        kinds.append(sgd.next_kind())
        result = sgd.advance(lambda: pending.pop(0))
        if result is not None:
            losses.append(result.loss)
    return losses, kinds


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_layer_steps_compute_what_one_sgd_step_computes() -> None:
    """Segment by segment forward and backward, and the update in chunks, equal torch.optim.SGD bit for bit."""
    batches = _batches(3, 4)
    ref_model, _ = _small_net(batch_norm=True)
    ref = _reference(ref_model, batches)
    model, segments = _small_net(batch_norm=True)
    losses, kinds = _staged(model, segments, batches, micro_batch_size=4, layer_steps=True, chunk_elems=1000)
    assert losses == pytest.approx(ref, rel=1e-6)
    for key, value in _params(ref_model).items():
        assert torch.equal(value, model.state_dict()[key]), key
    chunks = len(_plan_chunks([p.numel() for p in model.parameters()], 1000))
    one_batch = ["forward0", "forward1", "forward2", "backward2", "backward1", "backward0"]
    assert kinds == (one_batch + [f"update{c}" for c in range(chunks)]) * 3


def test_micro_batches_accumulate_the_batch_gradient() -> None:
    batches = _batches(3, 6)
    for layer_steps in (False, True):
        # neither batch norm nor dropout, whose statistics and masks depend on how a batch is split
        model, segments = _small_net(batch_norm=False, dropout=0.0)
        ref_model, _ = _small_net(batch_norm=False, dropout=0.0)
        ref = _reference(ref_model, batches)
        losses, kinds = _staged(model, segments, batches, micro_batch_size=2, layer_steps=layer_steps)
        if not layer_steps:
            assert kinds == ["micro", "micro", "micro", "update"] * 3
        assert losses == pytest.approx(ref, rel=1e-5)
        for key, value in _params(ref_model).items():
            assert torch.allclose(value, model.state_dict()[key], rtol=1e-5, atol=1e-7), key


def test_a_large_linear_layer_runs_a_block_of_rows_per_step() -> None:
    """A linear layer of over 1000 weights, forward and backward in blocks of rows: same numbers up to rounding."""

    def net() -> tuple[nn.Module, list[nn.Module]]:
        torch.manual_seed(0)
        segments = [
            nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=True)),
            nn.Sequential(nn.Flatten(1)),
            nn.Sequential(nn.Linear(256, 40), nn.ReLU(inplace=True), nn.Dropout(0.3)),
            nn.Sequential(nn.Linear(40, 5)),
        ]
        return nn.Sequential(*segments), segments

    batches = _batches(3, 4)
    ref_model, _ = net()
    ref = _reference(ref_model, batches)
    blocks = -(-40 // (1000 // 256))  # 3 rows of 256 weights per step
    for micro in (4, 2):  # with two micro-batches, the second adds to the gradient buffers the first filled
        model, segments = net()
        losses, kinds = _staged(model, segments, batches, micro_batch_size=micro, layer_steps=True, chunk_elems=1000)
        forward = ["forward0", "forward1", *(f"forward2.{j}" for j in range(blocks)), "forward3"]
        assert kinds[: len(forward)] == forward
        assert kinds.count("backward2.0") == 3 * (4 // micro)
        assert losses == pytest.approx(ref, rel=1e-5)
        for key, value in _params(ref_model).items():
            assert torch.allclose(value, model.state_dict()[key], rtol=1e-5, atol=1e-6), (micro, key)


def test_chunks_cover_every_element_once() -> None:
    sizes = [5, 3, 10, 1]
    chunks = _plan_chunks(sizes, 4)
    assert all(sum(hi - lo for _, lo, hi in chunk) <= 4 for chunk in chunks)
    covered = [(i, e) for chunk in chunks for i, lo, hi in chunk for e in range(lo, hi)]
    assert covered == [(i, e) for i, size in enumerate(sizes) for e in range(size)]
    assert _plan_chunks(sizes, float("inf")) == [[(0, 0, 5), (1, 0, 3), (2, 0, 10), (3, 0, 1)]]


async def _run(task: IterativeTask, steps: int) -> list[str]:
    """Run up to ``steps`` task steps; the kind of each."""
    gate = UnboundedGate()
    await run_alone(task, steps=steps, ctx=_ctx(), gate=gate)
    return gate.kinds


def _ctx() -> TaskContext:
    return TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=Path("."))


def test_a_checkpoint_at_any_step_boundary_resumes_exactly() -> None:
    """Mid-forward, mid-backward, between micro-batches and mid-update: the resumed run ends bit-identical."""
    options = dict(TINY, steps=2, micro_batch_size=2, layer_steps=True)
    reference = ResNet18Training(**options)
    kinds = asyncio.run(_run(reference, 10_000))
    assert reference.done_steps == 2
    cuts = [
        kinds.index("forward3"),  # mid-forward of the first micro-batch
        kinds.index("backward5"),  # mid-backward
        kinds.index("forward0", 1),  # between the two micro-batches
        kinds.index("update1"),  # mid-update
        len(kinds) - 3,  # late in the second batch
    ]
    for cut in cuts:
        first = ResNet18Training(**options)
        asyncio.run(_run(first, cut))
        saved = io.BytesIO()
        torch.save(first.state_dict(), saved)
        saved.seek(0)
        resumed = ResNet18Training(**options)
        resumed.load_state_dict(torch.load(saved, weights_only=False))
        asyncio.run(_run(resumed, 10_000))
        assert resumed.done_steps == 2 and resumed.loss == reference.loss, cut
        for key, value in reference.model.state_dict().items():
            assert torch.equal(value, resumed.model.state_dict()[key]), (cut, key)


def test_checkpoints_refuse_a_different_granularity_mid_run() -> None:
    staged = ResNet18Training(**TINY, micro_batch_size=2)
    asyncio.run(_run(staged, 1))
    plain = ResNet18Training(**TINY)
    plain.load_state_dict(staged.state_dict())
    with pytest.raises(ValueError, match="same options"):
        asyncio.run(plain.setup(_ctx()))


def test_inference_in_layer_steps_scores_as_in_whole_batches() -> None:
    options = dict(TINY, eval_size=16, fit_steps=3, steps=3 + 4)  # 3 fitting steps, one pass of 4 batches
    whole = ResNet18Inference(**options)
    layered = ResNet18Inference(**options, layer_steps=True)
    asyncio.run(run_alone(whole, steps=10_000))
    kinds = asyncio.run(_run(layered, 10_000))
    assert whole.metrics()["passes"] == layered.metrics()["passes"] == 1
    assert whole.metrics()["top1"] == layered.metrics()["top1"]
    assert kinds[-10:] == [f"infer{k}" for k in range(10)]


def test_options_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="micro_batch_size must divide batch_size"):
        ResNet18Training(batch_size=8, micro_batch_size=3)
    with pytest.raises(ValueError, match="batch norm needs at least 2 values"):
        ResNet50Training(batch_size=1)
    with pytest.raises(ValueError, match="batch norm needs at least 2 values"):
        ResNet18Training(batch_size=4, micro_batch_size=1)
    ResNet18Training(batch_size=1, image_size=64)  # a 2x2 last stage is enough
