"""Image-processing side task: each operation against a plain-loop reference, and exact resume."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _sidetaskfix import cpu_context, deterministic_one_thread  # noqa: F401 - autouse fixture

from freeride.sidetask import run_alone
from freeride.sidetasks._imageio import read_image, write_pnm
from freeride.sidetasks._imageops import (
    edge_pipeline,
    equalize_hist,
    gaussian_blur,
    sobel,
    synthetic_scene,
    to_gray,
)
from freeride.sidetasks.imaging import ImageProcessing

# --- references: direct formulas, pixel by pixel, in float64 numpy --------------------------------


def _at(img: np.ndarray, y: int, x: int) -> float:
    """Pixel with the border replicated."""
    h, w = img.shape
    return float(img[min(max(y, 0), h - 1), min(max(x, 0), w - 1)])


def _ref_blur(img: np.ndarray, sigma: float) -> np.ndarray:
    r = math.ceil(3 * sigma)
    weights = {
        (a, b): math.exp(-(a * a + b * b) / (2 * sigma * sigma)) for a in range(-r, r + 1) for b in range(-r, r + 1)
    }
    total = sum(weights.values())
    out = np.zeros_like(img, dtype=np.float64)
    for y in range(img.shape[0]):
        for x in range(img.shape[1]):
            out[y, x] = sum(wt * _at(img, y + a, x + b) for (a, b), wt in weights.items()) / total
    return out


def _ref_sobel(img: np.ndarray) -> np.ndarray:
    out = np.zeros_like(img, dtype=np.float64)
    for y in range(img.shape[0]):
        for x in range(img.shape[1]):
            gx = (_at(img, y - 1, x + 1) + 2 * _at(img, y, x + 1) + _at(img, y + 1, x + 1)) - (
                _at(img, y - 1, x - 1) + 2 * _at(img, y, x - 1) + _at(img, y + 1, x - 1)
            )
            gy = (_at(img, y + 1, x - 1) + 2 * _at(img, y + 1, x) + _at(img, y + 1, x + 1)) - (
                _at(img, y - 1, x - 1) + 2 * _at(img, y - 1, x) + _at(img, y - 1, x + 1)
            )
            out[y, x] = math.hypot(gx, gy) / (4 * math.sqrt(2))
    return out


def _ref_equalize(img: np.ndarray) -> np.ndarray:
    levels = np.rint(img * 255).astype(int).ravel()
    ranked = np.sort(levels)
    n = levels.size
    lowest = int(np.searchsorted(ranked, ranked[0], side="right"))  # pixels at the darkest level
    if lowest == n:
        return np.zeros_like(img, dtype=np.float64)
    at_or_below = np.searchsorted(ranked, levels, side="right")
    return np.asarray((at_or_below - lowest) / (n - lowest), dtype=np.float64).reshape(img.shape)


def _grey_levels(n: int, h: int, w: int, seed: int) -> torch.Tensor:
    """Grey images on exact 8-bit levels, so that quantising them is unambiguous."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(40, 200, (n, 1, h, w), generator=g).float() / 255.0


# --- operations ------------------------------------------------------------------------------------


def test_gray_is_bt601_luma() -> None:
    x = torch.rand(2, 3, 5, 4, generator=torch.Generator().manual_seed(0))
    expected = 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]
    torch.testing.assert_close(to_gray(x)[:, 0], expected)
    assert torch.equal(to_gray(x[:, :1]), x[:, :1])


@pytest.mark.parametrize("sigma", [0.7, 1.5])
def test_blur_matches_direct_2d_convolution(sigma: float) -> None:
    x = torch.rand(2, 2, 9, 13, generator=torch.Generator().manual_seed(1))
    ours = gaussian_blur(x, sigma)
    for n in range(2):
        for c in range(2):
            np.testing.assert_allclose(ours[n, c].numpy(), _ref_blur(x[n, c].double().numpy(), sigma), atol=1e-5)


def test_sobel_matches_direct_formula() -> None:
    x = torch.rand(2, 1, 10, 7, generator=torch.Generator().manual_seed(2))
    ours = sobel(x)
    for n in range(2):
        np.testing.assert_allclose(ours[n, 0].numpy(), _ref_sobel(x[n, 0].double().numpy()), atol=1e-5)


def test_sobel_of_a_step_edge_is_maximal_on_the_edge_only() -> None:
    x = torch.zeros(1, 1, 6, 6)
    x[..., 3:] = 1.0
    edges = sobel(x)[0, 0]
    assert torch.all(edges[:, :2] == 0) and torch.all(edges[:, 4:] == 0)
    torch.testing.assert_close(edges[:, 2], torch.full((6,), 4 / (4 * math.sqrt(2))))


def test_equalize_matches_rank_formula() -> None:
    x = _grey_levels(3, 11, 9, seed=3)
    ours = equalize_hist(x)
    for n in range(3):
        np.testing.assert_allclose(ours[n, 0].numpy(), _ref_equalize(x[n, 0].double().numpy()), atol=1e-6)
    assert ours.amin().item() == 0.0 and ours.amax().item() == pytest.approx(1.0)


def test_equalize_of_a_flat_image_is_zero() -> None:
    assert torch.equal(equalize_hist(torch.full((1, 1, 4, 4), 0.5)), torch.zeros(1, 1, 4, 4))


def test_pipeline_is_equalize_then_blur_then_sobel() -> None:
    x = _grey_levels(1, 12, 10, seed=4)
    eq, blurred, edges = edge_pipeline(x, 1.0)
    ref_eq = _ref_equalize(x[0, 0].double().numpy())
    ref_blur = _ref_blur(ref_eq, 1.0)
    np.testing.assert_allclose(eq[0, 0].numpy(), ref_eq, atol=1e-6)
    np.testing.assert_allclose(blurred[0, 0].numpy(), ref_blur, atol=1e-5)
    np.testing.assert_allclose(edges[0, 0].numpy(), _ref_sobel(ref_blur), atol=1e-5)


def test_synthetic_scenes_are_reproducible_and_distinct() -> None:
    a = synthetic_scene(5, 32, seed=0)
    assert a.shape == (3, 32, 32) and a.min() >= 0.0 and a.max() <= 1.0
    assert torch.equal(a, synthetic_scene(5, 32, seed=0))
    assert not torch.equal(a, synthetic_scene(6, 32, seed=0))
    assert not torch.equal(a, synthetic_scene(5, 32, seed=1))


# --- the task --------------------------------------------------------------------------------------

OPTS: dict[str, Any] = {"images": 11, "batch_size": 3, "image_size": 24, "sigma": 1.2, "seed": 5}


async def test_task_processes_every_image_once(tmp_path: Path) -> None:
    task = ImageProcessing(**OPTS, output_dir="edges")
    durations = await run_alone(task, steps=100, ctx=cpu_context(tmp_path))
    assert len(durations) == 4 and task.done()  # 3 + 3 + 3 + 2
    files = sorted((tmp_path / "edges").glob("*.pgm"))
    assert [f.name for f in files] == [f"edges_{i:08d}.pgm" for i in range(11)]
    batch = torch.stack([synthetic_scene(i, 24, seed=5) for i in range(11)])
    _, _, edges = edge_pipeline(batch, 1.2)
    assert task.metrics()["edge_mean"] == pytest.approx(edges.double().mean().item(), rel=1e-6)
    saved = read_image(files[7])[0]
    torch.testing.assert_close(saved, (edges[7, 0] * 255).round() / 255, atol=1e-6, rtol=0)


async def test_resume_from_disk_gives_identical_results(tmp_path: Path) -> None:
    straight = ImageProcessing(**OPTS, output_dir="a")
    await run_alone(straight, steps=100, ctx=cpu_context(tmp_path))

    first = ImageProcessing(**OPTS, output_dir="b")
    await run_alone(first, steps=2, ctx=cpu_context(tmp_path))
    torch.save(first.state_dict(), tmp_path / "ckpt.pt")
    second = ImageProcessing(**OPTS, output_dir="b")
    second.load_state_dict(torch.load(tmp_path / "ckpt.pt"))
    steps = await run_alone(second, steps=100, ctx=cpu_context(tmp_path))

    assert len(steps) == 2
    for key in ("processed", "edge_mean", "steps"):
        assert second.metrics()[key] == straight.metrics()[key]
    for f in sorted((tmp_path / "a").iterdir()):
        assert (tmp_path / "b" / f.name).read_bytes() == f.read_bytes()


async def test_task_reads_a_folder(tmp_path: Path) -> None:
    data = tmp_path / "photos"
    (data / "sub").mkdir(parents=True)
    write_pnm(data / "a.ppm", synthetic_scene(0, 20, seed=1))
    write_pnm(data / "sub" / "b.pgm", synthetic_scene(1, 30, seed=1)[0])
    np.save(data / "c.npy", (synthetic_scene(2, 16, seed=1).permute(1, 2, 0).numpy() * 255).astype(np.uint8))
    (data / "notes.txt").write_text("not an image")
    task = ImageProcessing(data_dir=str(data), image_size=16, batch_size=2)
    assert task.images == 3
    await run_alone(task, steps=10, ctx=cpu_context(tmp_path))
    assert task.metrics()["processed"] == 3.0 and task.done()
    assert task.metrics()["edge_mean"] > 0.0


@pytest.mark.parametrize(("option", "value"), [("batch_size", 0), ("sigma", 0.0), ("images", -1), ("image_size", 2)])
def test_bad_options_name_the_field(option: str, value: Any) -> None:
    kwargs: dict[str, Any] = {option: value}
    with pytest.raises(ValueError, match=option):
        ImageProcessing(**kwargs)
