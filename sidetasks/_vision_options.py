"""The options the vision tasks share: checked once, and turned into the image sets, the network and its optimizer."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from freeride.sidetasks._data import ImageFolder, LabelledImages, SyntheticImages
from freeride.sidetasks._models import build_model
from freeride.sidetasks._options import check_at_least

__all__ = ["VisionOptions"]


def _resnet_final_side(image_size: int) -> int:
    """Side of the last stage's feature map: halved (rounding up) twice in the stem and once in three stages."""
    side = image_size
    for _ in range(5):
        side = (side + 1) // 2
    return side


class VisionOptions:
    """The options the training and inference tasks share, checked, and the data, network and optimizer they name."""

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
        check_at_least(1, batch_size=batch_size)
        check_at_least(self.min_image_size, image_size=image_size)
        check_at_least(0, steps=steps)
        check_at_least(1, train_size=train_size, eval_size=eval_size)
        if not (lr >= 0 and math.isfinite(lr)):
            raise ValueError(f"lr must be a finite number > 0 (or 0 for the architecture's default), got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        check_at_least(0, weight_decay=weight_decay)
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

    def _new_model(self, device: torch.device) -> nn.Module:
        """The architecture's network for the options' classes, its weights seeded by ``seed``, on ``device``."""
        return build_model(self.arch, self.num_classes, seed=self.seed).to(device)

    def _new_optimizer(self, model: nn.Module) -> torch.optim.SGD:
        """SGD over ``model``'s parameters with the options' ``lr``, ``momentum`` and ``weight_decay``."""
        return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)

    def _fingerprint(self) -> dict[str, Any]:
        return {"task": type(self).__name__, "num_classes": self.num_classes, "image_size": self.image_size}
