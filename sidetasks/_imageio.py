"""Reading and writing image files without new dependencies.

Netpbm (``.pgm``, ``.ppm``, ``.pnm``; binary and ASCII) and NumPy ``.npy``
files are always readable; PNG and JPEG are readable only when Pillow is
importable. Images come back as float32 tensors ``(C, H, W)`` in ``[0, 1]``
with ``C`` 1 or 3.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

__all__ = ["IMAGE_SUFFIXES", "list_images", "read_image", "write_pnm"]

_PNM_SUFFIXES = frozenset({".pgm", ".ppm", ".pnm"})
_PIL_SUFFIXES = frozenset({".png", ".jpg", ".jpeg"})


def _pillow_available() -> bool:
    return importlib.util.find_spec("PIL") is not None


IMAGE_SUFFIXES: frozenset[str] = _PNM_SUFFIXES | {".npy"} | (_PIL_SUFFIXES if _pillow_available() else set())
"""Suffixes :func:`read_image` can decode here (PNG/JPEG only with Pillow)."""


def list_images(folder: Path) -> list[Path]:
    """Readable image files directly inside ``folder``, sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def _pnm_tokens(data: bytes, count: int) -> tuple[list[int], int]:
    """The first ``count`` header integers after the magic, and the offset just past them."""
    values: list[int] = []
    pos = 2
    while len(values) < count:
        while pos < len(data) and data[pos : pos + 1].isspace():
            pos += 1
        if data[pos : pos + 1] == b"#":
            while pos < len(data) and data[pos : pos + 1] not in (b"\n", b"\r"):
                pos += 1
            continue
        start = pos
        while pos < len(data) and data[pos : pos + 1].isdigit():
            pos += 1
        if start == pos:
            raise ValueError("malformed netpbm header")
        values.append(int(data[start:pos]))
    return values, pos


def _read_pnm(path: Path) -> torch.Tensor:
    data = path.read_bytes()
    magic = data[:2]
    if magic not in (b"P2", b"P3", b"P5", b"P6"):
        raise ValueError(f"{path}: unsupported netpbm type {magic!r} (need P2, P3, P5 or P6)")
    channels = 3 if magic in (b"P3", b"P6") else 1
    (width, height, maxval), pos = _pnm_tokens(data, 3)
    if not 0 < maxval < 65536:
        raise ValueError(f"{path}: bad maxval {maxval}")
    count = width * height * channels
    if magic in (b"P2", b"P3"):
        flat = torch.tensor([int(t) for t in data[pos:].split()[:count]], dtype=torch.float32)
    else:
        raw = data[pos + 1 :]  # exactly one whitespace byte separates header and raster
        width_bytes = 1 if maxval < 256 else 2
        need = count * width_bytes
        if len(raw) < need:
            raise ValueError(f"{path}: raster truncated ({len(raw)} < {need} bytes)")
        u8 = torch.frombuffer(bytearray(raw[:need]), dtype=torch.uint8)
        if width_bytes == 1:
            flat = u8.to(torch.float32)
        else:  # big-endian 16-bit samples
            pairs = u8.view(-1, 2).to(torch.float32)
            flat = pairs[:, 0] * 256 + pairs[:, 1]
    if flat.numel() != count:
        raise ValueError(f"{path}: expected {count} samples, found {flat.numel()}")
    return (flat / maxval).view(height, width, channels).permute(2, 0, 1).contiguous()


def _read_npy(path: Path) -> torch.Tensor:
    import numpy as np

    arr = np.load(path, allow_pickle=False)
    if arr.dtype == np.uint8:
        t = torch.from_numpy(arr.astype(np.float32) / 255.0)
    elif arr.dtype == np.uint16:
        t = torch.from_numpy(arr.astype(np.float32) / 65535.0)
    else:
        t = torch.from_numpy(arr.astype(np.float32)).clamp(0.0, 1.0)
    if t.ndim == 2:
        return t.unsqueeze(0)
    if t.ndim == 3 and t.shape[-1] in (1, 3, 4) and t.shape[0] > 4:
        t = t.permute(2, 0, 1)
    if t.ndim != 3 or t.shape[0] not in (1, 3, 4):
        raise ValueError(f"{path}: need an HxW, HxWxC or CxHxW array with C in 1, 3, 4; got {tuple(arr.shape)}")
    return t[:3].contiguous() if t.shape[0] == 4 else t.contiguous()


def _read_pil(path: Path) -> torch.Tensor:
    import numpy as np

    image_module = importlib.import_module("PIL.Image")  # optional dependency, imported only when present
    with image_module.open(path) as img:
        arr = np.asarray(img.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(arr.astype(np.float32) / 255.0).permute(2, 0, 1).contiguous()


def read_image(path: Path) -> torch.Tensor:
    """Decode one image file.

    Returns:
        A float32 tensor ``(C, H, W)`` with values in ``[0, 1]``, ``C`` 1 or 3
        (an alpha channel is dropped).

    Raises:
        ValueError: for an unsupported suffix or a malformed file.
    """
    suffix = path.suffix.lower()
    if suffix in _PNM_SUFFIXES:
        return _read_pnm(path)
    if suffix == ".npy":
        return _read_npy(path)
    if suffix in _PIL_SUFFIXES:
        if not _pillow_available():
            raise ValueError(f"{path}: reading {suffix} needs Pillow, which is not installed")
        return _read_pil(path)
    raise ValueError(f"{path}: unsupported image type {suffix!r}")


def write_pnm(path: Path, image: torch.Tensor) -> None:
    """Write ``image`` (``(H, W)`` or ``(C, H, W)``, values in ``[0, 1]``) as binary PGM/PPM.

    The file appears atomically: it is written under a temporary name and
    renamed, so a reader (or a writer restarted after a kill) never sees half
    an image.
    """
    img = image.detach().to("cpu", torch.float32)
    if img.ndim == 3 and img.shape[0] == 1:
        img = img[0]
    if img.ndim == 2:
        magic, hwc = b"P5", img.unsqueeze(-1)
    elif img.ndim == 3 and img.shape[0] == 3:
        magic, hwc = b"P6", img.permute(1, 2, 0)
    else:
        raise ValueError(f"image must be (H, W), (1, H, W) or (3, H, W); got {tuple(image.shape)}")
    u8 = (hwc.clamp(0.0, 1.0) * 255.0).round().to(torch.uint8).contiguous()
    header = b"%s\n%d %d\n255\n" % (magic, u8.shape[1], u8.shape[0])
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(header + u8.numpy().tobytes())
    os.replace(tmp, path)
