"""A model ``torch.fx`` cannot trace, as one graph of ATen operations from ``torch.export``.

``torch.fx`` runs a forward on proxies: a branch on a tensor's value or shape,
item assignment on a tensor, or a forward wrapped by decorators that take
``*args, **kwargs`` (every Hugging Face model, ``nn.LSTM``, ``nn.Transformer``)
stops it. ``torch.export`` runs the forward on fake tensors of the first
batch's shapes instead, so such Python runs for real and only the operations
on tensors are recorded: a graph with one node per operation and the model's
own parameters (the same ``Parameter`` objects, so the optimizer built on the
model updates them). The graph holds for inputs of those shapes (a batch of
other shapes is refused by the graph's input check) and for the mode the model
was in (training or eval).

The model's output may be any nesting of containers (see
:mod:`freeride.partition.values`): the graph returns its tensors, and the output
is built again around them, each container as its type. Objects that are
neither (a Hugging Face key-value cache) come back as ``None``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import fx, nn

from freeride.partition.values import flatten, inputs, tensors

__all__ = ["export"]

logger = logging.getLogger(__name__)


class _Flat(nn.Module):
    """``model``, called with the batch input's arguments, returning its output's tensors as a flat tuple.

    How to build the output again goes into ``found``: not an attribute, which export would restore.
    """

    def __init__(self, model: nn.Module, found: list[tuple[Callable[[Sequence[Any]], Any], list[str]]]) -> None:
        super().__init__()
        self.model = model
        self._found = found

    def forward(self, *args: Any) -> tuple[torch.Tensor, ...]:
        leaves, build, dropped = flatten(self.model(*args))
        self._found.append((build, dropped))
        return tuple(leaves)


def export(model: nn.Module, x: object) -> tuple[fx.GraphModule, Callable[[Sequence[Any]], Any]]:
    """``model``'s forward on the batch input ``x`` as an ATen graph, and what builds its output from the graph's.

    The graph's inputs are the tensors of :func:`~freeride.partition.values.inputs` of ``x``, in order.

    Raises:
        ValueError: ``x`` holds values other than tensors (the graph would take them as constants).
        Exception: whatever ``torch.export`` raises on a forward it cannot export.
    """
    args = inputs(x)
    found: list[tuple[Callable[[Sequence[Any]], Any], list[str]]] = []
    flat = _Flat(model, found)
    with torch.enable_grad(), warnings.catch_warnings():  # enabled: the graph must record what backward needs
        # nn.LSTM keeps its weights in a list too: export warns that those are not registered; they are
        # the registered parameters, which the graph reads
        warnings.filterwarnings("ignore", message="The tensor attributes", category=UserWarning)
        program = torch.export.export(flat, tuple(args), strict=False)
    module = program.module()
    if not isinstance(module, fx.GraphModule):
        raise TypeError(f"torch.export gave a {type(module).__name__}, not a GraphModule")
    placeholders = sum(1 for n in module.graph.nodes if n.op == "placeholder")
    if placeholders != len(list(tensors(args))):
        raise ValueError(
            f"the model's inputs hold values other than tensors ({placeholders} graph inputs for"
            f" {len(list(tensors(args)))} tensors): give tensors, or tuples of them"
        )
    build, dropped = found[-1]
    if dropped:
        logger.info(
            "[partition] %s: torch.export cannot carry %s out of the forward: None in the output instead",
            type(model).__name__,
            ", ".join(sorted(set(dropped))),
        )
    return module, build
