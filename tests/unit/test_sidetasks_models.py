"""The packaged ResNet/VGG definitions match torchvision's published architectures."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from freeride.sidetasks._models import ARCHITECTURES, ResNet, build_model

# Parameter counts torchvision publishes for its ImageNet weights (1000 classes):
# https://pytorch.org/vision/stable/models.html ("Params" column).
PUBLISHED_PARAMS = {"resnet18": 11_689_512, "resnet50": 25_557_032, "vgg19": 143_667_240}
# Weight layers: 3x3/7x7/1x1 convolutions (downsampling shortcuts included) and linear layers.
CONV_AND_LINEAR = {"resnet18": (20, 1), "resnet50": (53, 1), "vgg19": (16, 3)}


def _on_meta(arch: str, num_classes: int) -> nn.Module:
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        return ARCHITECTURES[arch](num_classes)


@pytest.mark.parametrize("arch", sorted(PUBLISHED_PARAMS))
def test_parameter_count_matches_torchvision(arch: str) -> None:
    model = _on_meta(arch, 1000)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[arch]


@pytest.mark.parametrize("arch", sorted(CONV_AND_LINEAR))
def test_layer_counts(arch: str) -> None:
    model = _on_meta(arch, 1000)
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert (convs, linears) == CONV_AND_LINEAR[arch]


def test_resnet50_puts_the_stride_on_the_3x3_conv() -> None:
    model: Any = _on_meta("resnet50", 1000)
    first = model.layer2[0]
    assert first.conv1.stride == (1, 1) and first.conv2.stride == (2, 2)


@pytest.mark.parametrize(("arch", "size"), [("resnet18", 16), ("resnet50", 16), ("vgg19", 32)])
def test_forward_shape(arch: str, size: int) -> None:
    model = _on_meta(arch, 7)
    assert model(torch.empty(2, 3, size, size, device="meta")).shape == (2, 7)


def test_seeded_init() -> None:
    a, b, c = (build_model("resnet18", 7, seed=s) for s in (3, 3, 4))
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert isinstance(a, ResNet) and isinstance(c, ResNet)
    assert not torch.equal(a.conv1.weight, c.conv1.weight)
    a.eval()
    with torch.inference_mode():
        assert a(torch.randn(2, 3, 16, 16)).shape == (2, 7)


def test_build_model_leaves_the_global_rng_alone() -> None:
    state = torch.get_rng_state()
    build_model("resnet18", 10, seed=0)
    assert torch.equal(torch.get_rng_state(), state)


def test_unknown_architecture() -> None:
    with pytest.raises(ValueError, match="arch"):
        build_model("alexnet", 10, seed=0)
