"""Batch image processing: histogram equalisation, Gaussian blur, Sobel edges."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from freeride.sidetask import TaskContext
from freeride.sidetasks._common import DeviceTask, check_fingerprint, synchronize
from freeride.sidetasks._imageio import IMAGE_SUFFIXES, read_image, write_pnm
from freeride.sidetasks._imageops import edge_pipeline, synthetic_scene
from freeride.sidetasks._options import check_at_least, check_positive

__all__ = ["ImageProcessing"]

logger = logging.getLogger(__name__)


class ImageProcessing(DeviceTask):
    """Equalise, blur and edge-detect images in batches; one step is one batch.

    The images are synthetic scenes (reproducible from ``seed``; see
    :func:`~freeride.sidetasks._imageops.synthetic_scene`) or every readable
    image under ``data_dir`` in path order (``.pgm``/``.ppm``/``.pnm``/``.npy``,
    PNG/JPEG only with Pillow), resized to ``image_size`` squared so that they
    batch.

    Options: ``batch_size`` (16), ``image_size`` (128), ``images`` (how many to
    process; 0: all of ``data_dir``, or synthetic ones until stopped),
    ``sigma`` (1.5, blur width in pixels), ``seed`` (0), ``data_dir`` (""),
    ``output_dir`` ("": write nothing; else a folder, relative to the task's
    work directory, receiving ``edges_<index>.pgm``).

    Metrics: ``processed``, ``edge_mean`` (mean edge strength over all images
    processed, a checksum of the work), ``images_per_s`` (pipeline only),
    ``steps``.
    """

    def __init__(
        self,
        *,
        batch_size: int = 16,
        image_size: int = 128,
        images: int = 0,
        sigma: float = 1.5,
        seed: int = 0,
        data_dir: str = "",
        output_dir: str = "",
    ) -> None:
        super().__init__()
        check_at_least(1, batch_size=batch_size)
        check_at_least(4, image_size=image_size)
        check_at_least(0, images=images)
        check_positive(sigma=sigma)
        self.files: list[Path] = []
        if data_dir:
            root = Path(data_dir).expanduser()
            if not root.is_dir():
                raise ValueError(f"data_dir {data_dir!r} is not a directory")
            self.files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
            if not self.files:
                raise ValueError(f"data_dir {data_dir!r} holds no readable images")
            images = min(images, len(self.files)) if images else len(self.files)
        self.batch_size, self.image_size, self.images = batch_size, image_size, images
        self.sigma, self.seed, self.output_dir = sigma, seed, output_dir
        self.position = 0
        self.edge_sum = 0.0
        self.seconds = 0.0
        self.done_steps = 0
        self._out: Path | None = None

    def _build(self, ctx: TaskContext) -> None:
        if self.output_dir:
            self._out = ctx.workdir / self.output_dir
            self._out.mkdir(parents=True, exist_ok=True)
        logger.info("[setup] imaging: %s images of %dpx on %s", self.images or "endless", self.image_size, self.device)

    def _load(self, index: int) -> torch.Tensor:
        if not self.files:
            return synthetic_scene(index, self.image_size, seed=self.seed)
        img = read_image(self.files[index])
        img = img.expand(3, -1, -1) if img.shape[0] == 1 else img
        size = (self.image_size, self.image_size)
        if tuple(img.shape[1:]) == size:
            return img
        return F.interpolate(img.unsqueeze(0), size=size, mode="bilinear", antialias=True, align_corners=False)[0]

    def process(self, indices: range) -> torch.Tensor:
        """Run the pipeline on the given images and return their edge maps ``(N, 1, S, S)``."""
        batch = torch.stack([self._load(i) for i in indices]).to(self.device, non_blocking=True)
        _, _, edges = edge_pipeline(batch, self.sigma)
        return edges

    def step(self) -> None:
        stop = self.position + self.batch_size
        if self.images:
            stop = min(stop, self.images)
        indices = range(self.position, stop)
        t0 = time.perf_counter()
        edges = self.process(indices)
        synchronize(self.device)
        self.seconds += time.perf_counter() - t0
        self.edge_sum += float(edges.mean(dim=(1, 2, 3), dtype=torch.float64).sum())
        if self._out is not None:
            cpu = edges.cpu()
            for k, index in enumerate(indices):
                write_pnm(self._out / f"edges_{index:08d}.pgm", cpu[k, 0])
        self.position = stop
        self.done_steps += 1

    def done(self) -> bool:
        return self.images > 0 and self.position >= self.images

    def metrics(self) -> dict[str, float]:
        return {
            "processed": float(self.position),
            "edge_mean": self.edge_sum / self.position if self.position else math.nan,
            "images_per_s": self.position / self.seconds if self.seconds > 0 else math.nan,
            "steps": float(self.done_steps),
        }

    def _fingerprint(self) -> dict[str, Any]:
        return {"image_size": self.image_size, "sigma": self.sigma, "seed": self.seed, "files": len(self.files)}

    def _capture(self) -> dict[str, Any]:
        return {
            "fingerprint": self._fingerprint(),
            "position": self.position,
            "edge_sum": self.edge_sum,
            "seconds": self.seconds,
            "steps": self.done_steps,
        }

    def _restore(self, state: dict[str, Any]) -> None:
        check_fingerprint(state, self._fingerprint())
        self.position = int(state["position"])
        self.edge_sum = float(state["edge_sum"])
        self.seconds = float(state["seconds"])
        self.done_steps = int(state["steps"])
