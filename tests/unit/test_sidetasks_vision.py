"""ResNet-18 training and inference tasks: learning, top-1, exact resume, folder data."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _torchfix import deterministic_one_thread  # noqa: F401 - autouse fixture

from freeride.partition import _common as common_module
from freeride.partition import plan as plan_module
from freeride.sidetask import TaskContext, run_alone
from freeride.sidetasks._imageio import write_pnm
from freeride.sidetasks.vision import ResNet18Inference, ResNet18Training, VGG19Training

SMALL: dict[str, Any] = {
    "image_size": 16,
    "num_classes": 4,
    "batch_size": 16,
    "train_size": 1024,
    "eval_size": 64,
    "seed": 0,
}
CHANCE = 1 / SMALL["num_classes"]


def _ctx(tmp_path: Path) -> TaskContext:
    return TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=tmp_path)


async def _losses(task: ResNet18Training, batches: int, ctx: TaskContext) -> list[float]:
    """The loss after each of the next ``batches`` optimizer steps, each taken in the partitioner's task steps."""
    out = []
    for _ in range(batches):
        done = task.metrics()["steps"]
        while task.metrics()["steps"] == done:
            await run_alone(task, steps=1, ctx=ctx)  # setup() builds once; later calls continue
        out.append(task.metrics()["loss"])
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], Path]:
    """Loss trajectory of 30 training steps, and the saved final state.

    The same run every time: this short run's trajectory is chaotic, and the loss ratio the test below
    checks came out 0.40-0.62 from run to run. Deterministic kernels here too (a module's fixture is
    built before the autouse one of its first test), and the partitioner's clock replaced by a counter,
    so that its plan (which sets the order gradients are summed in) does not follow this machine's
    timings.
    """
    import asyncio

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.MonkeyPatch.context() as mp:
            counter = lambda device: itertools.count(0.0, 1e-4).__next__  # noqa: E731
            mp.setattr(plan_module, "timer", counter)  # the plan's timings
            mp.setattr(common_module, "timer", counter)  # the drift that regroups it
            path = tmp_path_factory.mktemp("vision")
            task = ResNet18Training(**SMALL)
            losses = asyncio.run(_losses(task, 30, _ctx(path)))
            torch.save(task.state_dict(), path / "trained.pt")
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.set_num_threads(threads)
    return losses, path / "trained.pt"


def test_training_loss_goes_down(trained: tuple[list[float], Path]) -> None:
    losses, _ = trained
    assert all(math.isfinite(x) for x in losses)
    assert np.median(losses[-10:]) < 0.5 * np.median(losses[:5])  # medians: single batches are noisy


async def test_inference_from_a_training_checkpoint_beats_chance(
    trained: tuple[list[float], Path], tmp_path: Path
) -> None:
    task = ResNet18Inference(**SMALL, checkpoint=str(trained[1]))
    assert task.fit_steps == 0
    await run_alone(task, steps=4, ctx=_ctx(tmp_path))  # 64 held-out images, 16 a batch
    m = task.metrics()
    assert m["passes"] == 1.0 and m["fitting"] == 0.0
    assert m["top1"] > 2.4 * CHANCE
    assert m["images_per_s"] > 0


async def test_inference_fits_first_without_a_checkpoint(tmp_path: Path) -> None:
    task = ResNet18Inference(**SMALL, fit_steps=3)
    await run_alone(task, steps=2, ctx=_ctx(tmp_path))
    assert task.metrics()["fitting"] == 1.0 and task.optimizer is not None
    await run_alone(task, steps=1, ctx=_ctx(tmp_path))
    assert task.metrics()["fitting"] == 0.0 and task.optimizer is None  # momentum buffers freed
    assert math.isnan(task.metrics()["top1"])
    await run_alone(task, steps=4, ctx=_ctx(tmp_path))
    assert task.metrics()["passes"] == 1.0 and task.metrics()["steps"] == 7.0
    assert ResNet18Inference(**SMALL).fit_steps == 100  # the default without a checkpoint


async def test_an_untrained_model_scores_near_chance(tmp_path: Path) -> None:
    task = ResNet18Inference(**SMALL, fit_steps=0)
    await run_alone(task, steps=4, ctx=_ctx(tmp_path))
    assert task.metrics()["top1"] < 2 * CHANCE  # so the tests above measure learning


async def test_training_resumes_from_disk_on_the_same_trajectory(tmp_path: Path) -> None:
    # one piece per pass: both tasks run the same plan whatever this machine's timing (two timed plans sum
    # gradients in another order, and batch norm over 1x1 maps amplifies that rounding to ~1 % in 4 batches)
    opts = {**SMALL, "batch_size": 8, "target_ms": 1e6}
    straight = ResNet18Training(**opts)
    expected = await _losses(straight, 4, _ctx(tmp_path))

    first = ResNet18Training(**opts)
    got = await _losses(first, 2, _ctx(tmp_path))
    torch.save(first.state_dict(), tmp_path / "ckpt.pt")
    rng_at_checkpoint = torch.get_rng_state()
    torch.rand(100)  # move the process RNG on (VGG's dropout draws from it): restoring must undo that
    second = ResNet18Training(**opts)
    second.load_state_dict(torch.load(tmp_path / "ckpt.pt"))  # before setup, as a worker does
    await second.setup(_ctx(tmp_path))
    assert torch.equal(torch.get_rng_state(), rng_at_checkpoint)
    got += await _losses(second, 2, _ctx(tmp_path))

    assert got == expected
    for a, b in zip(straight.model.state_dict().values(), second.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert second.metrics()["samples"] == straight.metrics()["samples"] == 32.0


async def test_training_resumes_from_a_mid_batch_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every piece timed at 0.1 ms by a counting clock: the same pieces in the three tasks whatever this
    # machine's timing (a slow node is opened and a wide layer split by its measured time, and other pieces
    # sum gradients in another order), grouped ~5 to a step: several steps per batch.
    monkeypatch.setattr(plan_module, "timer", lambda device: itertools.count(0.0, 1e-4).__next__)
    opts = {**SMALL, "batch_size": 8, "target_ms": 0.5}
    straight = ResNet18Training(**opts)
    expected = await _losses(straight, 3, _ctx(tmp_path))

    first = ResNet18Training(**opts)
    got = await _losses(first, 1, _ctx(tmp_path))
    per_batch = int(first.metrics()["steps_per_batch"])
    assert per_batch > 3
    await run_alone(first, steps=per_batch // 2, ctx=_ctx(tmp_path))  # stop inside the second batch
    assert first.metrics()["steps"] == 1.0
    torch.save(first.state_dict(), tmp_path / "mid.pt")
    second = ResNet18Training(**opts)
    second.load_state_dict(torch.load(tmp_path / "mid.pt", weights_only=True))
    await second.setup(_ctx(tmp_path))
    assert second.metrics()["steps"] == 1.0
    got += await _losses(second, 2, _ctx(tmp_path))

    assert got == expected
    for a, b in zip(straight.model.state_dict().values(), second.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_micro_batches_are_refused_and_layer_steps_ignored() -> None:
    with pytest.raises(ValueError, match="lower batch_size"):
        ResNet18Training(batch_size=8, micro_batch_size=2)
    assert ResNet18Training(batch_size=8, micro_batch_size=8, layer_steps=True).batch_size == 8


async def test_inference_resumes_mid_pass(tmp_path: Path) -> None:
    opts = {**SMALL, "eval_size": 40, "fit_steps": 2}
    straight = ResNet18Inference(**opts)
    await run_alone(straight, steps=7, ctx=_ctx(tmp_path))  # 2 fit + 3 batches (one pass) + 2 batches

    first = ResNet18Inference(**opts)
    await run_alone(first, steps=3, ctx=_ctx(tmp_path))
    second = ResNet18Inference(**opts)
    await second.setup(_ctx(tmp_path))
    second.load_state_dict(first.state_dict())  # after setup works too
    await run_alone(second, steps=4, ctx=_ctx(tmp_path))

    keys = ("top1", "top1_running", "passes", "fit_loss", "steps")
    assert {k: second.metrics()[k] for k in keys} == {k: straight.metrics()[k] for k in keys}
    assert straight.metrics()["passes"] == 1.0


async def test_training_on_a_folder_of_images(tmp_path: Path) -> None:
    data = tmp_path / "data"
    g = torch.Generator().manual_seed(0)
    for c, name in enumerate(["cat", "dog", "eel"]):
        (data / name).mkdir(parents=True)
        for k in range(6):
            img = (torch.rand(3, 12, 10, generator=g) * 0.3 + 0.3 * c).clamp(0, 1)
            if k % 2:
                write_pnm(data / name / f"{k}.ppm", img)
            else:
                np.save(data / name / f"{k}.npy", (img[0].numpy() * 255).astype(np.uint8))
    task = ResNet18Training(data_dir=str(data), image_size=16, batch_size=4)
    assert task.num_classes == 3
    assert (len(task.train), len(task.eval)) == (15, 3)  # every tenth file of a class (here: the first) is held out
    await _losses(task, 2, _ctx(tmp_path))
    assert task.metrics()["samples"] == 8.0 and math.isfinite(task.metrics()["loss"])


async def test_checkpoint_of_another_task_is_refused(tmp_path: Path) -> None:
    task = ResNet18Training(**SMALL)
    other = ResNet18Training(**{**SMALL, "num_classes": 5})
    await other.setup(_ctx(tmp_path))
    task.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="num_classes=5"):
        await task.setup(_ctx(tmp_path))


@pytest.mark.parametrize(
    ("option", "value"),
    [("batch_size", 0), ("image_size", 4), ("lr", -1.0), ("momentum", 1.0), ("num_classes", 1), ("steps", -1)],
)
def test_bad_options_name_the_field(option: str, value: Any) -> None:
    kwargs: dict[str, Any] = {option: value}
    with pytest.raises(ValueError, match=option):
        ResNet18Training(**kwargs)


def test_vgg_needs_32_pixels() -> None:
    with pytest.raises(ValueError, match="image_size must be >= 32"):
        VGG19Training(image_size=16)


def test_learning_rate_defaults_per_architecture() -> None:
    assert ResNet18Training().lr == 0.01
    assert VGG19Training().lr == 0.002  # plain VGG spikes at 0.01 with small batches
    assert VGG19Training(lr=0.05).lr == 0.05
