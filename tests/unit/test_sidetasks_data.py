"""Image files, labelled image sets and the resumable data cursor used by the sample tasks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from freeride.sidetasks._common import ShuffledCursor
from freeride.sidetasks._data import ImageFolder, SyntheticImages
from freeride.sidetasks._imageio import IMAGE_SUFFIXES, list_images, read_image, write_pnm


def _levels(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed)).float() / 255


@pytest.mark.parametrize("shape", [(5, 7), (3, 5, 7)])
def test_pnm_round_trip(tmp_path: Path, shape: tuple[int, ...]) -> None:
    img = _levels(shape)
    path = tmp_path / "x.pnm"
    write_pnm(path, img)
    assert path.read_bytes().startswith(b"P5" if len(shape) == 2 else b"P6")
    back = read_image(path)
    assert back.shape == (1 if len(shape) == 2 else 3, 5, 7)
    torch.testing.assert_close(back.squeeze(0) if len(shape) == 2 else back, img, atol=1e-6, rtol=0)
    assert not list(tmp_path.glob(".*.tmp"))


def test_ascii_and_16_bit_pnm(tmp_path: Path) -> None:
    (tmp_path / "a.pgm").write_bytes(b"P2\n# comment\n3 2\n10\n0 5 10\n10 5 0\n")
    torch.testing.assert_close(read_image(tmp_path / "a.pgm")[0], torch.tensor([[0.0, 0.5, 1.0], [1.0, 0.5, 0.0]]))
    (tmp_path / "b.ppm").write_bytes(b"P3 1 1 255 255 0 51\n")
    torch.testing.assert_close(read_image(tmp_path / "b.ppm")[:, 0, 0], torch.tensor([1.0, 0.0, 0.2]))
    (tmp_path / "c.pgm").write_bytes(b"P5\n2 1\n65535\n" + bytes([0xFF, 0xFF, 0x80, 0x00]))
    torch.testing.assert_close(read_image(tmp_path / "c.pgm")[0, 0], torch.tensor([1.0, 32768 / 65535]))


def test_truncated_or_unknown_files_are_rejected(tmp_path: Path) -> None:
    (tmp_path / "t.pgm").write_bytes(b"P5\n4 4\n255\n\x00\x01")
    with pytest.raises(ValueError, match="truncated"):
        read_image(tmp_path / "t.pgm")
    (tmp_path / "bitmap.pgm").write_bytes(b"P4\n1 1\n\x00")
    with pytest.raises(ValueError, match="P4"):
        read_image(tmp_path / "bitmap.pgm")
    with pytest.raises(ValueError, match="unsupported"):
        read_image(tmp_path / "x.tiff")


@pytest.mark.parametrize(
    ("shape", "dtype", "scale"),
    [((6, 4), np.uint8, 255), ((6, 4, 3), np.uint8, 255), ((3, 6, 4), np.float32, 1), ((6, 4, 4), np.uint16, 65535)],
)
def test_npy_layouts(tmp_path: Path, shape: tuple[int, ...], dtype: type, scale: int) -> None:
    arr: np.ndarray = (np.arange(np.prod(shape)).reshape(shape) % 7 * (scale // 7 if scale > 1 else 0.1)).astype(dtype)
    np.save(tmp_path / "a.npy", arr)
    img = read_image(tmp_path / "a.npy")
    assert img.shape[1:] == (6, 4) and img.shape[0] in (1, 3)
    chw = arr if shape[0] == 3 else (arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)[:3])
    np.testing.assert_allclose(img.numpy(), chw.astype(np.float64) / scale, atol=1e-6)


def test_pillow_formats_only_with_pillow() -> None:
    try:
        import PIL  # noqa: F401
    except ImportError:
        assert ".png" not in IMAGE_SUFFIXES
    else:
        assert {".png", ".jpg", ".jpeg"} <= IMAGE_SUFFIXES


def test_synthetic_images_are_reproducible_and_share_classes_across_splits() -> None:
    a = SyntheticImages(num_classes=5, image_size=16, size=50, seed=1, split=0)
    b = SyntheticImages(num_classes=5, image_size=16, size=50, seed=1, split=0)
    ev = SyntheticImages(num_classes=5, image_size=16, size=50, seed=1, split=1)
    xa, ya = a.batch([3, 7, 7])
    xb, yb = b.batch([3, 7, 7])
    assert torch.equal(xa, xb) and torch.equal(ya, yb) and torch.equal(xa[1], xa[2])
    assert torch.equal(a.prototypes, ev.prototypes)
    assert not torch.equal(a.batch([0])[0], ev.batch([0])[0])
    _, labels = a.batch(range(50))
    assert set(labels.tolist()) == set(range(5))
    with pytest.raises(IndexError):
        a.sample(50)


def test_synthetic_classes_are_separable_by_their_prototypes() -> None:
    data = SyntheticImages(num_classes=6, image_size=16, size=200, seed=2, split=0, noise=1.0)
    x, y = data.batch(range(200))
    # Nearest prototype by correlation over all circular shifts the generator may apply.
    reach = 16 // 8
    shifted = torch.stack(
        [
            torch.roll(data.prototypes, shifts=(dy, dx), dims=(2, 3))
            for dy in range(-reach, reach + 1)
            for dx in range(-reach, reach + 1)
        ]
    )  # (shifts, classes, 3, S, S)
    scores = torch.einsum("nchw,skchw->nsk", x, shifted).amax(1)
    assert (scores.argmax(1) == y).float().mean() > 0.9


def test_image_folder_splits_and_labels(tmp_path: Path) -> None:
    for name, count in (("b", 12), ("a", 3)):
        (tmp_path / name).mkdir()
        for k in range(count):
            write_pnm(tmp_path / name / f"{k:02d}.pgm", torch.full((4, 6), k / 20))
    (tmp_path / "a" / "readme.txt").write_text("ignored")
    train = ImageFolder(tmp_path, image_size=8, split=0)
    ev = ImageFolder(tmp_path, image_size=8, split=1)
    assert train.classes == ["a", "b"] and train.num_classes == 2
    assert [p.name for p, _ in ev.items] == ["00.pgm", "00.pgm", "10.pgm"]
    assert len(train) == 15 - 3
    x, y = train.batch([0, len(train) - 1])
    assert x.shape == (2, 3, 8, 8) and y.tolist() == [0, 1]
    assert len(list_images(tmp_path / "a")) == 3


def test_image_folder_needs_two_classes(tmp_path: Path) -> None:
    (tmp_path / "only").mkdir()
    with pytest.raises(ValueError, match="two class"):
        ImageFolder(tmp_path, image_size=8, split=0)


def test_cursor_visits_each_index_once_per_epoch_and_resumes() -> None:
    cursor = ShuffledCursor(10, seed=3)
    first = cursor.take(7)
    second = cursor.take(7)  # crosses into epoch 1
    assert sorted(first + second[:3]) == list(range(10))
    assert cursor.epoch == 1 and cursor.position == 14
    resumed = ShuffledCursor(10, seed=3)
    resumed.position = 7
    assert resumed.take(7) == second
    assert ShuffledCursor(10, seed=3, shuffle=False).take(12) == [*range(10), 0, 1]
