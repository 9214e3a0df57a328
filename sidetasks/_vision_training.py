"""Vision training tasks: SGD on the image set, one batch per optimizer step, partitioned into bubble-sized steps."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F

from freeride.partition import PartitionedTraining, TrainingParts
from freeride.sidetasks._batches import ShuffledBatches
from freeride.sidetasks._common import check_fingerprint
from freeride.sidetasks._vision_options import VisionOptions

__all__ = ["VisionTraining"]

logger = logging.getLogger("freeride.sidetasks.vision")  # logged under the module the tasks are named by


class VisionTraining(VisionOptions, PartitionedTraining):
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
        model = self._new_model(self.device)
        optimizer = self._new_optimizer(model)
        data = ShuffledBatches(self.train, batch_size=self.batch_size, seed=self.seed, device=self.device)
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
