"""Vision inference tasks: classify the held-out split batch by batch, after fitting or loading a model."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from freeride.sidetask import TaskContext
from freeride.sidetasks._common import synchronize
from freeride.sidetasks._vision_task import VisionTask

__all__ = ["VisionInference"]

logger = logging.getLogger("freeride.sidetasks.vision")  # logged under the module the tasks are named by


class VisionInference(VisionTask):
    """Classify the held-out split batch by batch; one step is one batch.

    Takes the training options plus ``checkpoint`` (path of a ``torch.save``-d
    training-task state or model ``state_dict``; "" for none) and
    ``fit_steps`` (training steps taken as the first task steps; -1: 0 with a
    checkpoint, 100 without). ``steps`` counts fit and inference steps. Each
    fit step is one whole SGD step; ``layer_steps`` (true) runs one model
    segment's forward per inference step; ``micro_batch_size`` is refused
    unless 0 or ``batch_size``, as for the training tasks.

    Metrics: ``top1`` (last complete pass over the held-out split, else the
    running pass), ``top1_running``, ``passes``, ``images_per_s`` (forward
    passes only), ``fitting`` (1 while still fitting), ``fit_loss``,
    ``steps``.
    """

    def __init__(
        self,
        *,
        checkpoint: str = "",
        fit_steps: int = -1,
        batch_size: int = 8,
        image_size: int = 32,
        num_classes: int = 0,
        lr: float = 0.0,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        steps: int = 0,
        seed: int = 0,
        data_dir: str = "",
        train_size: int = 8192,
        eval_size: int = 1024,
        noise: float = 1.0,
        micro_batch_size: int = 0,
        layer_steps: bool = False,
    ) -> None:
        self._check_options(
            batch_size=batch_size,
            image_size=image_size,
            num_classes=num_classes,
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            steps=steps,
            seed=seed,
            data_dir=data_dir,
            train_size=train_size,
            eval_size=eval_size,
            noise=noise,
            micro_batch_size=micro_batch_size,
            layer_steps=layer_steps,
        )
        super().__init__(steps=steps, layer_steps=layer_steps)
        if fit_steps < -1:
            raise ValueError(f"fit_steps must be >= 0 (or -1 for automatic), got {fit_steps}")
        self.checkpoint = checkpoint
        self.fit_steps = fit_steps if fit_steps >= 0 else (0 if checkpoint else 100)
        self.offset = 0
        self.correct = 0
        self.seen = 0
        self.passes = 0
        self.top1_last = math.nan
        self.infer_images = 0
        self.infer_seconds = 0.0
        self._act: torch.Tensor | None = None
        """With layer steps: the batch's activation after ``_segment`` segments."""
        self._segment = 0
        self._labels = torch.empty(0, dtype=torch.int64)

    def _build(self, ctx: TaskContext) -> None:
        super()._build(ctx)
        if self.checkpoint:
            loaded = torch.load(Path(self.checkpoint).expanduser(), map_location=self.device, weights_only=True)
            weights = loaded.get("model", loaded) if isinstance(loaded, dict) else loaded
            self.model.load_state_dict(weights)
            logger.info("[setup] %s: weights from %s", type(self).__name__, self.checkpoint)
        if self.fit_steps == 0:
            self.optimizer = None
        self._segments = self.model.segments() if self.layer_steps else []  # type: ignore[operator]
        forward = self._segment_costs(self.batch_size)
        if self._segments:
            self._costs.update({f"infer{k}": cost for k, cost in enumerate(forward)})
        else:
            self._costs["infer"] = sum(forward)

    def step_kind(self) -> str:
        if self.done_steps < self.fit_steps:
            return ""
        return f"infer{self._segment}" if self.layer_steps else "infer"

    def step(self) -> None:
        if self.done_steps < self.fit_steps:
            self._fit_step()
            self.done_steps += 1
            if self.done_steps == self.fit_steps:
                self.optimizer = None  # momentum buffers are not needed for inference
            return
        stop = min(self.offset + self.batch_size, len(self.eval))
        self.model.eval()
        t0 = time.perf_counter()
        with torch.inference_mode():
            if not self._segments:
                x, y = self.eval.batch(range(self.offset, stop))
                logits = self.model(x.to(self.device, non_blocking=True))
            else:
                if self._act is None:
                    x, self._labels = self.eval.batch(range(self.offset, stop))
                    self._act = x.to(self.device, non_blocking=True)
                self._act = self._segments[self._segment](self._act)
                self._segment += 1
                if self._segment < len(self._segments):
                    synchronize(self.device)
                    self.infer_seconds += time.perf_counter() - t0
                    return
                logits, y, self._act, self._segment = self._act, self._labels, None, 0
            pred = logits.argmax(1).cpu()
        synchronize(self.device)
        self.infer_seconds += time.perf_counter() - t0
        self.infer_images += stop - self.offset
        self.correct += int((pred == y).sum())
        self.seen += stop - self.offset
        self.offset = stop
        if self.offset == len(self.eval):
            self.top1_last = self.correct / self.seen
            self.passes += 1
            self.offset = self.correct = self.seen = 0
        self.done_steps += 1

    def done(self) -> bool:
        return self.steps > 0 and self.done_steps >= self.steps

    def metrics(self) -> dict[str, float]:
        running = self.correct / self.seen if self.seen else math.nan
        return {
            "top1": running if math.isnan(self.top1_last) else self.top1_last,
            "top1_running": running,
            "passes": float(self.passes),
            "images_per_s": self.infer_images / self.infer_seconds if self.infer_seconds > 0 else math.nan,
            "fitting": float(self.done_steps < self.fit_steps),
            "fit_loss": self.loss,
            "steps": float(self.done_steps),
        }

    def _capture(self) -> dict[str, Any]:
        state = self._capture_common()
        state["eval"] = {
            "offset": self.offset,
            "correct": self.correct,
            "seen": self.seen,
            "passes": self.passes,
            "top1_last": self.top1_last,
            "infer_images": self.infer_images,
            "infer_seconds": self.infer_seconds,
        }
        return state

    def _restore(self, state: dict[str, Any]) -> None:
        self._restore_common(state)
        ev = state["eval"]
        self.offset, self.correct, self.seen = int(ev["offset"]), int(ev["correct"]), int(ev["seen"])
        self.passes, self.top1_last = int(ev["passes"]), float(ev["top1_last"])
        self.infer_images, self.infer_seconds = int(ev["infer_images"]), float(ev["infer_seconds"])
