"""MobileNetV2 image classification, trained in bubble-sized steps with no hand splitting.

The network is MobileNetV2's (inverted residual blocks: a 1x1 expansion, a
3x3 depthwise convolution, a linear 1x1 projection, a skip connection where
the shape allows), scaled for small images. Nothing splits it by hand:
:class:`freeride.partition.PartitionedTraining` traces it, opens slow blocks
and splits wide convolutions and the classifier by output as the bubbles of
its device require. The data is the synthetic labelled image set of the
vision samples (see :class:`freeride.sidetasks._data.SyntheticImages`), walked in a
seeded order that a restore resumes without replaying it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from freeride.partition import PartitionedTraining, TrainingParts
from freeride.sidetasks._batches import ShuffledBatches
from freeride.sidetasks._data import SyntheticImages
from freeride.sidetasks._options import check_at_least, check_positive

__all__ = ["MobileNetV2Training"]

_BLOCKS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))
"""(expansion, output channels, repeats, stride of the first) per stage, as in the paper (its stem: stride 2)."""


def _channels(c: int, width: float) -> int:
    return max(8, int(c * width + 4) // 8 * 8)


class _ConvBN(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True) -> None:
        layers: list[nn.Module] = [
            nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
        ]
        if act:
            layers.append(nn.ReLU6(inplace=True))
        super().__init__(*layers)


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = [_ConvBN(cin, hidden, 1)] if expand != 1 else []
        layers += [_ConvBN(hidden, hidden, 3, stride, groups=hidden), _ConvBN(hidden, cout, 1, act=False)]
        self.conv = nn.Sequential(*layers)
        self.skip = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.conv(x)
        return x + out if self.skip else out


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int, width: float = 1.0, dropout: float = 0.2) -> None:
        super().__init__()
        cin = _channels(32, width)
        blocks: list[nn.Module] = [_ConvBN(3, cin, 3)]
        for expand, c, repeats, stride in _BLOCKS:
            cout = _channels(c, width)
            for i in range(repeats):
                blocks.append(InvertedResidual(cin, cout, stride if i == 0 else 1, expand))
                cin = cout
        last = _channels(1280, max(1.0, width))
        blocks.append(_ConvBN(cin, last, 1))
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.classifier(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))
        return logits


class MobileNetV2Training(PartitionedTraining):
    """Train MobileNetV2 with SGD (momentum, weight decay) on synthetic images.

    Options (keyword arguments): ``batch_size`` (8), ``image_size`` (32),
    ``num_classes`` (10), ``width`` (0.5: the channel multiplier), ``lr``
    (0.01), ``momentum`` (0.9), ``weight_decay`` (4e-5), ``seed`` (0: weights,
    data and order), ``train_size`` (8192), ``noise`` (1.0: synthetic pixel
    noise), and the partitioning options ``target_ms`` (the longest a step
    should take; 0: sized from the device's bubbles), ``steps`` (0: until stopped; else batches) and
    ``profile_runs`` (2).

    Metrics: ``loss`` (last batch), ``loss_ema``, ``batches``, ``steps_per_batch``.
    """

    def __init__(
        self,
        *,
        batch_size: int = 8,
        image_size: int = 32,
        num_classes: int = 10,
        width: float = 0.5,
        lr: float = 0.01,
        momentum: float = 0.9,
        weight_decay: float = 4e-5,
        seed: int = 0,
        train_size: int = 8192,
        noise: float = 1.0,
        target_ms: float = 0.0,
        steps: int = 0,
        profile_runs: int = 2,
    ) -> None:
        super().__init__(target_ms=target_ms, steps=steps, profile_runs=profile_runs)
        if batch_size < 2:
            raise ValueError(f"batch_size must be >= 2 (batch norm needs two values per channel), got {batch_size}")
        check_at_least(8, image_size=image_size)
        check_at_least(2, num_classes=num_classes)
        if not (width > 0 and math.isfinite(width)):
            raise ValueError(f"width must be a positive number, got {width}")
        check_positive(lr=lr)
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        check_at_least(0, weight_decay=weight_decay)
        check_at_least(1, train_size=train_size)
        self.batch_size, self.image_size, self.num_classes, self.width = batch_size, image_size, num_classes, width
        self.lr, self.momentum, self.weight_decay, self.seed = lr, momentum, weight_decay, seed
        self.train_size, self.noise = train_size, noise

    def build(self) -> TrainingParts:
        torch.manual_seed(self.seed)
        model = MobileNetV2(self.num_classes, self.width).to(self.device)
        optimizer = torch.optim.SGD(
            model.parameters(), lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )
        images = SyntheticImages(
            num_classes=self.num_classes,
            image_size=self.image_size,
            size=self.train_size,
            seed=self.seed,
            split=0,
            noise=self.noise,
        )
        data = ShuffledBatches(images, batch_size=self.batch_size, seed=self.seed, device=self.device)
        return TrainingParts(model, optimizer, F.cross_entropy, data)
