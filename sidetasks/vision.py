"""Image-classification side tasks: training and batch inference of ResNet18/50 and VGG19.

Data never comes from the network. By default it is a synthetic labelled set
(noisy, shifted copies of one smooth random pattern per class; see
:class:`~freeride.sidetasks._data.SyntheticImages`) that a network can learn
within a few hundred steps. With ``data_dir`` it is a folder holding one
sub-folder of images per class; ``.ppm``/``.pgm``/``.pnm`` and ``.npy`` files
are always read, PNG and JPEG only when Pillow is installed. Every tenth file
of a class is held out for evaluation.

Training tasks are :class:`freeride.partition.PartitionedTraining` tasks: one
SGD step (momentum, weight decay) per batch, which the partitioner cuts at
setup into task steps sized for the device's bubbles (``target_ms``), with the
same arithmetic and exact checkpoints at every step. Inference tasks classify one batch of the held-out split per
step and report throughput and top-1 accuracy; their model comes from
``checkpoint`` (a saved training-task state or a bare model ``state_dict``) or,
without one, from ``fit_steps`` training steps taken as their first steps.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from freeride.partition import PartitionedTraining, TrainingParts
from freeride.sidetask import TaskContext
from freeride.sidetasks._common import (
    DeviceTask,
    ShuffledCursor,
    capture_rng,
    check_fingerprint,
    restore_rng,
    synchronize,
)
from freeride.sidetasks._cost import UPDATE_COST_PER_ELEMENT, backward_cost, segment_costs
from freeride.sidetasks._data import ImageFolder, LabelledImages, SyntheticImages
from freeride.sidetasks._models import build_model

__all__ = [
    "ResNet18Inference",
    "ResNet18Training",
    "ResNet50Inference",
    "ResNet50Training",
    "VGG19Inference",
    "VGG19Training",
]

logger = logging.getLogger(__name__)

_EMA = 0.9


def _resnet_final_side(image_size: int) -> int:
    """Side of the last stage's feature map: halved (rounding up) twice in the stem and once in three stages."""
    side = image_size
    for _ in range(5):
        side = (side + 1) // 2
    return side


class _Options:
    """The options the training and inference tasks share, checked, and the data they name."""

    arch: ClassVar[str] = ""
    default_lr: ClassVar[float] = 0.01
    """Learning rate used when the ``lr`` option is 0."""
    min_image_size: ClassVar[int] = 8
    """Smallest input side the architecture's pooling stages accept."""

    def _check_options(
        self,
        *,
        batch_size: int,
        image_size: int,
        num_classes: int,
        lr: float,
        momentum: float,
        weight_decay: float,
        steps: int,
        seed: int,
        data_dir: str,
        train_size: int,
        eval_size: int,
        noise: float,
        micro_batch_size: int,
        layer_steps: bool,
    ) -> None:
        for name, value, low in (("batch_size", batch_size, 1), ("image_size", image_size, self.min_image_size)):
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        for name, value in (("steps", steps), ("train_size", train_size), ("eval_size", eval_size)):
            if value < 0 or (value == 0 and name != "steps"):
                raise ValueError(f"{name} must be {'>= 0' if name == 'steps' else '>= 1'}, got {value}")
        if not (lr >= 0 and math.isfinite(lr)):
            raise ValueError(f"lr must be a finite number > 0 (or 0 for the architecture's default), got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if num_classes == 1 or num_classes < 0:
            raise ValueError(f"num_classes must be >= 2 (or 0 for automatic), got {num_classes}")
        if not isinstance(layer_steps, bool):
            raise ValueError(f"layer_steps must be true or false, got {layer_steps!r}")
        if micro_batch_size not in (0, batch_size):
            raise ValueError(
                f"micro_batch_size is no longer supported (got {micro_batch_size}): steps are split automatically"
                f" to fit target_ms; to make each step cheaper, lower batch_size ({batch_size}) or target_ms"
            )
        if self.arch.startswith("resnet") and batch_size * _resnet_final_side(image_size) ** 2 < 2:
            raise ValueError(
                f"{self.arch} at image_size {image_size} ends in a 1x1 feature map, and batch norm needs at least"
                f" 2 values per channel when training: make batch_size >= 2 or image_size >= 33"
            )
        self.batch_size, self.image_size, self.seed = batch_size, image_size, seed
        self.lr = lr or self.default_lr
        self.momentum, self.weight_decay = momentum, weight_decay
        self.train: LabelledImages
        self.eval: LabelledImages
        if data_dir:
            root = Path(data_dir).expanduser()
            self.train = ImageFolder(root, image_size=image_size, split=0)
            self.eval = ImageFolder(root, image_size=image_size, split=1)
            if num_classes not in (0, self.train.num_classes):
                raise ValueError(f"num_classes is {num_classes} but data_dir has {self.train.num_classes} classes")
        else:
            classes = num_classes or 10
            self.train = SyntheticImages(
                num_classes=classes, image_size=image_size, size=train_size, seed=seed, split=0, noise=noise
            )
            self.eval = SyntheticImages(
                num_classes=classes, image_size=image_size, size=eval_size, seed=seed, split=1, noise=noise
            )
        self.num_classes = self.train.num_classes

    def _fingerprint(self) -> dict[str, Any]:
        return {"task": type(self).__name__, "num_classes": self.num_classes, "image_size": self.image_size}


class _VisionTask(_Options, DeviceTask):
    """Model, data and the whole-batch SGD step of the inference tasks (their ``fit_steps``)."""

    def __init__(
        self,
        *,
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
        super().__init__()
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
        self.steps, self.layer_steps = steps, bool(layer_steps)
        self.cursor = ShuffledCursor(len(self.train), seed=seed)
        self.done_steps = 0
        self.loss = math.nan
        self.loss_ema = math.nan
        self.batch_acc = math.nan
        self.model: nn.Module = nn.Identity()
        self.optimizer: torch.optim.Optimizer | None = None
        self._costs: dict[str, float] = {}
        """Relative work of each step kind (see :meth:`step_cost`), counted at setup."""

    def _new_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            self.model.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )

    def _build(self, ctx: TaskContext) -> None:
        self.model = build_model(self.arch, self.num_classes, seed=self.seed).to(self.device)
        self.optimizer = self._new_optimizer()
        forward = self._segment_costs(self.batch_size)
        backward = sum(backward_cost(cost, first=k == 0) for k, cost in enumerate(forward))
        params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self._costs = {"": sum(forward) + backward + params * UPDATE_COST_PER_ELEMENT}
        logger.info("[setup] %s: %s on %s, batch %d", type(self).__name__, self.arch, self.device, self.batch_size)

    def _segment_costs(self, batch: int) -> list[float]:
        return segment_costs(self.arch, num_classes=self.num_classes, batch=batch, image_size=self.image_size)

    def step_cost(self, kind: str) -> float | None:
        """Multiply-adds of the step's layers for its batch; None for a kind this task never runs."""
        return self._costs.get(kind)

    def _fit_step(self) -> None:
        """One SGD step on the next training batch."""
        if self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__}: step() before setup()")
        x, y = self.train.batch(self.cursor.take(self.batch_size))
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.model.train()
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        self.optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        self.optimizer.step()
        self.loss = loss.item()  # also waits for the step's kernels
        self.batch_acc = float((logits.argmax(1) == y).float().mean())
        self.loss_ema = self.loss if math.isnan(self.loss_ema) else _EMA * self.loss_ema + (1 - _EMA) * self.loss

    def _capture_common(self) -> dict[str, Any]:
        return {
            "fingerprint": self._fingerprint(),
            "model": self.model.state_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "position": self.cursor.position,
            "steps": self.done_steps,
            "loss": self.loss,
            "loss_ema": self.loss_ema,
            "batch_acc": self.batch_acc,
            "rng": capture_rng(self.device),
        }

    def _restore_common(self, state: dict[str, Any]) -> None:
        check_fingerprint(state, self._fingerprint())
        self.model.load_state_dict(state["model"])
        if state["optimizer"] is None:
            self.optimizer = None
        else:
            self.optimizer = self.optimizer or self._new_optimizer()
            self.optimizer.load_state_dict(state["optimizer"])
        self.cursor.position = int(state["position"])
        self.done_steps = int(state["steps"])
        self.loss, self.loss_ema = float(state["loss"]), float(state["loss_ema"])
        self.batch_acc = float(state["batch_acc"])
        restore_rng(state["rng"], self.device)


class _Shuffled:
    """Training batches in a fresh seeded order each epoch; batch ``i`` is a function of ``i`` alone."""

    def __init__(self, images: LabelledImages, *, batch_size: int, seed: int, device: torch.device) -> None:
        self.images, self.batch_size, self.seed, self.device = images, batch_size, seed, device

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.iter_from(0)

    def iter_from(self, i: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches from batch ``i`` on (a restore starts there without replaying the ones before)."""
        cursor = ShuffledCursor(len(self.images), seed=self.seed)
        cursor.position = i * self.batch_size
        while True:
            x, y = self.images.batch(cursor.take(self.batch_size))
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


class _Training(_Options, PartitionedTraining):
    """Train the network with SGD, one batch per optimizer step, cut automatically into bubble-sized task steps.

    Options (keyword arguments): ``batch_size`` (8), ``image_size`` (32,
    square), ``num_classes`` (0: 10 synthetic classes, or the class folders of
    ``data_dir``), ``lr`` (0: 0.01 for the ResNets, 0.002 for VGG-19), ``momentum`` (0.9),
    ``weight_decay`` (5e-4), ``steps`` (0: train until stopped; else
    optimizer steps, i.e. batches), ``seed`` (0: weights, data and order),
    ``data_dir`` ("": synthetic data), ``train_size``/``eval_size``
    (synthetic set sizes), ``noise`` (synthetic pixel noise), and the
    partitioner's ``target_ms`` (the longest a task step should take; 0, the
    default, sizes it from the device's bubbles) and
    ``profile_runs`` (2: timed runs per piece at setup).

    Deprecated: ``layer_steps`` is accepted and ignored (the partitioner always
    splits the step, finer than layer steps did where the bubbles need it);
    ``micro_batch_size`` is refused unless 0 or ``batch_size`` (the
    partitioner does not accumulate micro-batches: lower ``batch_size`` to
    make each step cheaper).

    Metrics: ``loss`` (last batch), ``loss_ema`` (smoothed), ``batch_acc``
    (last batch), ``samples``, ``epoch``, ``steps`` (optimizer steps), and the
    partitioner's ``batches`` and ``steps_per_batch``.
    """

    def __init__(
        self,
        *,
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
        target_ms: float = 0.0,
        profile_runs: int = 2,
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
        super().__init__(target_ms=target_ms, steps=steps, profile_runs=profile_runs)
        self._acc: torch.Tensor | None = None
        """The last batch's accuracy, left on the device (read only when metrics are)."""

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self._acc = (logits.detach().argmax(1) == y).float().mean()
        return F.cross_entropy(logits, y)

    def build(self) -> TrainingParts:
        model = build_model(self.arch, self.num_classes, seed=self.seed).to(self.device)
        optimizer = torch.optim.SGD(
            model.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )
        data = _Shuffled(self.train, batch_size=self.batch_size, seed=self.seed, device=self.device)
        logger.info("[setup] %s: %s on %s, batch %d", type(self).__name__, self.arch, self.device, self.batch_size)
        return TrainingParts(model, optimizer, self._loss, data)

    def metrics(self) -> dict[str, float]:
        samples = self.batches_done * self.batch_size
        return {
            **super().metrics(),
            "batch_acc": math.nan if self._acc is None or self.batches_done == 0 else float(self._acc),
            "samples": float(samples),
            "epoch": float(samples // len(self.train)),
            "steps": float(self.batches_done),
        }

    def extra_state(self) -> dict[str, Any]:
        return {"fingerprint": self._fingerprint()}

    def _restore(self, state: dict[str, Any]) -> None:
        check_fingerprint(state.get("extra") or {}, self._fingerprint())  # before weights of another shape fail
        super()._restore(state)


class _Inference(_VisionTask):
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
        super().__init__(
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


class ResNet18Training(_Training):
    __doc__ = "ResNet-18 training.\n\n" + (_Training.__doc__ or "")
    arch = "resnet18"


class ResNet50Training(_Training):
    __doc__ = "ResNet-50 training.\n\n" + (_Training.__doc__ or "")
    arch = "resnet50"


class VGG19Training(_Training):
    __doc__ = "VGG-19 training. Without batch norm it learns slowly at first.\n\n" + (_Training.__doc__ or "")
    arch = "vgg19"
    default_lr = 0.002  # without batch norm, 0.01 makes the loss spike at batch size 8
    min_image_size = 32


class ResNet18Inference(_Inference):
    __doc__ = "ResNet-18 batch inference.\n\n" + (_Inference.__doc__ or "")
    arch = "resnet18"


class ResNet50Inference(_Inference):
    __doc__ = "ResNet-50 batch inference.\n\n" + (_Inference.__doc__ or "")
    arch = "resnet50"


class VGG19Inference(_Inference):
    __doc__ = "VGG-19 batch inference.\n\n" + (_Inference.__doc__ or "")
    arch = "vgg19"
    default_lr = 0.002  # without batch norm, 0.01 makes the loss spike at batch size 8
    min_image_size = 32
