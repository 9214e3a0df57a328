"""ResNet and VGG image classifiers, layer for layer as torchvision defines them.

torchvision is not a dependency (its wheels pin a torch build), so the three
architectures the vision side tasks train are written out here. Layer counts,
widths, strides and initialisation follow ``torchvision.models`` (ResNet v1.5:
the stride of a bottleneck block sits on its 3x3 convolution), so parameter
counts match the published ones at 1000 classes: resnet18 11,689,512;
resnet50 25,557,032; vgg19 143,667,240.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["ARCHITECTURES", "ResNet", "VGG", "build_model", "resnet18", "resnet50", "vgg19"]


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


class _BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int, downsample: nn.Module | None) -> None:
        super().__init__()
        self.conv1 = _conv3x3(cin, width, stride)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(width, width)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        y: torch.Tensor = self.relu(out + identity)
        return y


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int, downsample: nn.Module | None) -> None:
        super().__init__()
        self.conv1 = _conv1x1(cin, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, width * self.expansion)
        self.bn3 = nn.BatchNorm2d(width * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        y: torch.Tensor = self.relu(out + identity)
        return y


class ResNet(nn.Module):
    """torchvision's ResNet: 7x7 stem, four stages, global average pool, linear head."""

    def __init__(self, block: type[_BasicBlock | _Bottleneck], layers: list[int], num_classes: int) -> None:
        super().__init__()
        self._cin = 64
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._stage(block, 64, layers[0], stride=1)
        self.layer2 = self._stage(block, 128, layers[1], stride=2)
        self.layer3 = self._stage(block, 256, layers[2], stride=2)
        self.layer4 = self._stage(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1.0)
                nn.init.constant_(m.bias, 0.0)

    def _stage(self, block: type[_BasicBlock | _Bottleneck], width: int, blocks: int, stride: int) -> nn.Sequential:
        out = width * block.expansion
        downsample: nn.Module | None = None
        if stride != 1 or self._cin != out:
            downsample = nn.Sequential(_conv1x1(self._cin, out, stride), nn.BatchNorm2d(out))
        mods: list[nn.Module] = [block(self._cin, width, stride, downsample)]
        self._cin = out
        mods += [block(out, width, 1, None) for _ in range(1, blocks)]
        return nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        y: torch.Tensor = self.fc(torch.flatten(self.avgpool(x), 1))
        return y

    def segments(self) -> list[nn.Module]:
        """The forward pass as a chain of modules (stem, each residual block, head), sharing this model's layers."""
        stem = nn.Sequential(self.conv1, self.bn1, self.relu, self.maxpool)
        blocks = [block for stage in (self.layer1, self.layer2, self.layer3, self.layer4) for block in stage]
        return [stem, *blocks, nn.Sequential(self.avgpool, nn.Flatten(1), self.fc)]


_VGG19_CONFIG: list[int] = [64, 64, 0, 128, 128, 0, 256, 256, 256, 256, 0, 512, 512, 512, 512, 0]
_VGG19_CONFIG += [512, 512, 512, 512, 0]  # 0 marks a 2x2 max pool


class VGG(nn.Module):
    """torchvision's VGG without batch norm: conv stack, 7x7 adaptive pool, 3-layer MLP head."""

    def __init__(self, config: list[int], num_classes: int, dropout: float = 0.5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for width in config:
            if width == 0:
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(cin, width, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
                cin = width
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, num_classes),
        )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    nn.init.constant_(m.bias, 0.0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
                nn.init.constant_(m.bias, 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        y: torch.Tensor = self.classifier(torch.flatten(x, 1))
        return y

    def segments(self) -> list[nn.Module]:
        """The forward pass as a chain of modules, sharing this model's layers.

        One segment per convolution (with its ReLU and any pooling after it)
        and per linear layer (with its ReLU and dropout): every segment starts
        with a layer whose input is not modified in place.
        """
        layers = [*self.features, nn.Sequential(self.avgpool, nn.Flatten(1)), *self.classifier]
        groups: list[list[nn.Module]] = []
        for layer in layers:
            if not groups or isinstance(layer, nn.Conv2d | nn.Linear | nn.Sequential):
                groups.append([layer])
            else:
                groups[-1].append(layer)
        return [nn.Sequential(*group) for group in groups]


def resnet18(num_classes: int = 1000) -> ResNet:
    """ResNet-18 (BasicBlock, 2-2-2-2)."""
    return ResNet(_BasicBlock, [2, 2, 2, 2], num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50 (Bottleneck, 3-4-6-3)."""
    return ResNet(_Bottleneck, [3, 4, 6, 3], num_classes)


def vgg19(num_classes: int = 1000) -> VGG:
    """VGG-19 (configuration E, no batch norm)."""
    return VGG(_VGG19_CONFIG, num_classes)


ARCHITECTURES: dict[str, Callable[[int], nn.Module]] = {
    "resnet18": resnet18,
    "resnet50": resnet50,
    "vgg19": vgg19,
}
"""Architecture name to builder taking ``num_classes``."""


def build_model(arch: str, num_classes: int, *, seed: int) -> nn.Module:
    """Build ``arch`` on the CPU with weights drawn from ``seed``.

    The process-wide RNG is forked, so building a model does not disturb it.

    Raises:
        ValueError: if ``arch`` is not in :data:`ARCHITECTURES`.
    """
    try:
        builder = ARCHITECTURES[arch]
    except KeyError:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}") from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return builder(num_classes)
