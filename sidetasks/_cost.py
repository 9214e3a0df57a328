"""The work of each segment of a vision model, counted from its layers' shapes.

A step kind that has not run yet is estimated from the kinds measured so far,
scaled by their relative work (see :meth:`freeride.sidetask.IterativeTask.step_cost`).
The work of a segment's forward pass is counted here in multiply-adds of its
convolutions and linear layers, plus one unit per output element of every
other layer (batch norm, activations, pooling: memory-bound, but cheap next to
a convolution). Shapes come from a forward pass of a copy of the model on
PyTorch's ``meta`` device, which allocates and computes nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from freeride.sidetasks._models import ARCHITECTURES

__all__ = ["UPDATE_COST_PER_ELEMENT", "backward_cost", "segment_costs"]

UPDATE_COST_PER_ELEMENT = 32.0
"""Work of the SGD update (momentum, weight decay) per parameter element, in multiply-add units.

Memory-bound: a handful of reads and writes per element, each worth tens of
multiply-adds of a convolution on CPUs and GPUs alike. Set high rather than
low, so that an update chunk not measured yet is estimated long rather than
short.
"""


def _leaf_cost(module: nn.Module, out: torch.Tensor) -> float:
    if isinstance(module, nn.Conv2d):
        kh, kw = module.kernel_size
        return float(out.numel()) * (module.in_channels // module.groups) * kh * kw
    if isinstance(module, nn.Linear):
        return float(out.numel()) * module.in_features
    return float(out.numel())


def segment_costs(arch: str, *, num_classes: int, batch: int, image_size: int) -> list[float]:
    """Forward work of each of ``arch``'s segments (its ``segments()``) for ``batch`` images.

    Raises:
        ValueError: if ``arch`` is unknown.
    """
    try:
        builder = ARCHITECTURES[arch]
    except KeyError:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}") from None
    with torch.device("meta"):
        model = builder(num_classes)
    model.eval()
    total = [0.0]

    def count(module: nn.Module, _inputs: object, out: object) -> None:
        if isinstance(out, torch.Tensor):
            total[0] += _leaf_cost(module, out)

    for module in model.modules():
        if not any(True for _ in module.children()):
            module.register_forward_hook(count)
    costs = []
    x = torch.empty(batch, 3, image_size, image_size, device="meta")
    with torch.no_grad():
        for segment in model.segments():  # type: ignore[operator]
            total[0] = 0.0
            x = segment(x)
            costs.append(total[0])
    return costs


def backward_cost(forward: float, *, first: bool) -> float:
    """Work of a segment's backward pass: gradients of its weights and (except the first) of its input.

    Counted high: each gradient costs about a forward pass on a GPU, but up to
    twice that on CPUs (weight gradients of small feature maps run inefficiently).
    """
    return 2 * forward if first else 3 * forward
