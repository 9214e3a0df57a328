"""A model as a sequence of small pieces that run forward and backward one at a time.

The model is traced with :mod:`torch.fx` down to the modules chosen as
leaves (at first its children; a slow child is opened into its own children
by tracing again). The graph's nodes, in order, are grouped into *atoms*: a
contiguous range of nodes, or one slice of a large ``Linear`` (by output
features) or ``Conv2d`` (by output channels). An atom's forward runs on the
values the earlier atoms left; where a value that needs a gradient crosses an
atom boundary it is detached into a fresh leaf, so each atom keeps its own
autograd graph and its backward is ``torch.autograd.backward(outputs,
leaf.grad)`` once the later atoms have filled those gradients in. Parameters
are never detached: they collect their gradients directly, as in a plain
``loss.backward()``.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from freeride.partition._compat import traceable_torch
from freeride.partition.values import inputs, rebuild, tensors

__all__ = ["Atom", "Executor", "NodeGraph", "split_count", "splittable", "trace"]

_INPLACE_FUNCTIONS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imod,
    operator.ipow,
    operator.iand,
    operator.ior,
    operator.ixor,
}


class _Tracer(fx.Tracer):
    """Traces every module not in ``opened`` as one call (a leaf)."""

    def __init__(self, opened: set[str]) -> None:
        super().__init__()
        self.opened = opened

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name not in self.opened

    def create_arg(self, a: Any) -> fx.node.Argument:
        if isinstance(a, dict) and dataclasses.is_dataclass(a):
            # a ModelOutput built of traced values: fx would make it a plain dict (a dataclass comes first
            # for fx only when it is no dict); built by its own constructor, it keeps its type and fields
            kwargs = {str(k): self.create_arg(v) for k, v in a.items()}
            return self.create_node("call_function", type(a), (), kwargs)
        return super().create_arg(a)

    def trace(self, root: nn.Module | Callable[..., Any], concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        with traceable_torch(self):
            return super().trace(root, concrete_args)


def trace(model: nn.Module, opened: set[str]) -> fx.Graph:
    """The graph of ``model``'s forward with the modules in ``opened`` (qualified names) traced into.

    Raises:
        torch.fx.proxy.TraceError: a traced forward branches on a tensor's value
            (the caller keeps that module closed).
    """
    return _Tracer(opened | {""}).trace(model)


def splittable(module: nn.Module) -> bool:
    """Whether a leaf can run as slices of its output features (``Linear``) or channels (``Conv2d``)."""
    if type(module) is nn.Linear:
        return module.out_features > 1
    if type(module) is nn.Conv2d:
        return module.groups == 1 and module.padding_mode == "zeros" and module.out_channels > 1
    return False


def split_count(module: nn.Module, cost_s: float, target_s: float) -> int:
    """Slices to run a splittable leaf in so that each takes at most about ``target_s``."""
    width = int(_layer(module).weight.shape[0])
    return max(1, min(width, math.ceil(cost_s / target_s)))


@dataclass(frozen=True, slots=True)
class Atom:
    """The smallest piece of work: nodes ``[start, stop)``, or slice ``part`` of ``parts`` of node ``start``."""

    start: int
    stop: int
    part: int = 0
    parts: int = 1

    @property
    def is_slice(self) -> bool:
        return self.parts > 1


@dataclass(slots=True)
class NodeGraph:
    """A traced model: its nodes in order, and where each node's value is last read."""

    model: nn.Module
    """What the graph's ``get_attr`` and ``call_module`` nodes name: the model, or the module exported of it."""
    graph: fx.Graph
    build_output: Callable[[Sequence[Any]], Any] | None = None
    """For an exported graph, which returns its output's tensors: the output built again around them."""
    nodes: list[fx.Node] = field(init=False)
    last_use: list[int] = field(init=False)
    index: dict[fx.Node, int] = field(init=False)

    def __post_init__(self) -> None:
        self.nodes = list(self.graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.last_use = [max((self.index[u] for u in n.users), default=i) for i, n in enumerate(self.nodes)]

    def module(self, i: int) -> nn.Module | None:
        node = self.nodes[i]
        if node.op != "call_module":
            return None
        return self.model.get_submodule(str(node.target))

    def where(self, i: int) -> str:
        """The module node ``i`` runs in, for messages: its target, or the innermost module it was exported from."""
        node = self.nodes[i]
        if node.op == "call_module":
            return str(node.target)
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        if not stack:
            return node.name
        path, kind = stack[-1]
        path = str(path).removeprefix("model").removeprefix(".")  # the exported wrapper's own attribute
        return f"{path or getattr(kind, '__name__', str(kind).rsplit('.', 1)[-1])}:{node.name}"

    def inplace(self, node: fx.Node) -> bool:
        """Whether ``node`` writes into its first argument (a boundary leaf must not be written)."""
        if node.op == "call_module":
            return bool(getattr(self.model.get_submodule(str(node.target)), "inplace", False))
        if node.op == "call_method":
            return str(node.target).endswith("_")
        if node.op == "call_function":
            name = getattr(node.target, "__name__", "").split(".")[0]  # an ATen op's overload: add_.Tensor
            return (
                node.target in _INPLACE_FUNCTIONS
                or bool(node.kwargs.get("inplace"))
                or (name.endswith("_") and not name.startswith("_"))
            )
        return False


def _detach(value: object, pairs: list[tuple[torch.Tensor, torch.Tensor]], clone: bool) -> object:
    """``value`` with every tensor that needs a gradient replaced by a fresh leaf; (tensor, leaf) into ``pairs``."""

    def leaf(v: object) -> object:
        if not isinstance(v, torch.Tensor) or not v.requires_grad or isinstance(v, nn.Parameter):
            return v
        fresh = v.detach().requires_grad_()
        pairs.append((v, fresh))
        return fresh.clone() if clone else fresh

    return rebuild(value, leaf)


def _layer(module: nn.Module | None) -> nn.Linear | nn.Conv2d:
    if not isinstance(module, nn.Linear | nn.Conv2d):
        raise TypeError(f"only Linear and Conv2d layers run in slices, not {type(module).__name__}")
    return module


def _rows(atom: Atom, module: nn.Linear | nn.Conv2d) -> tuple[int, int]:
    """The output features or channels slice ``atom`` computes."""
    width = int(module.weight.shape[0])
    return atom.part * width // atom.parts, (atom.part + 1) * width // atom.parts


class Executor:
    """Runs one batch through a :class:`NodeGraph` atom by atom, forward then backward.

    Args:
        graph: The traced model.
        atoms: Covering the graph's nodes in order.
        loss_fn: Applied to the model's output and the target in the atom holding
            the output node (training); ``None`` for inference.
    """

    def __init__(
        self,
        graph: NodeGraph,
        atoms: Sequence[Atom],
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    ) -> None:
        self.g = graph
        self.atoms = list(atoms)
        self.loss_fn = loss_fn
        self.grad = loss_fn is not None
        self._env: dict[int, Any] = {}
        self._saved: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self._slices: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]] = {}
        self._slice_leaf: dict[int, torch.Tensor] = {}
        self._written: set[int] = set()
        """Parameters (by id) whose gradient this batch's slices allocated: each slice writes its own rows."""
        self._grad_buffers: dict[int, torch.Tensor] = {}
        """Per sliced parameter (by id), the storage its gradient takes in every batch.

        A fresh one each batch cost its pages again: on CPU a tensor over glibc's largest
        mmap threshold (32 MB) comes from fresh pages and goes back on free, and each page's
        first write faults (VGG-19's first Linear: 411 MB, 100,000 faults a batch). Peak memory
        is the same: the gradient existed for most of each batch anyway. A checkpoint holds
        the gradient by reference as it holds the weights, and is written before the next step.
        """
        self._inputs: list[object] = []
        """The model's arguments for the batch in flight, in the order of the graph's placeholders."""
        self._target: object = None
        self.output: object = None
        self.loss: torch.Tensor | None = None

    def begin(self, x: object, target: object = None) -> None:
        """Start a batch: ``x`` is the model's input, ``target`` the loss's second argument."""
        self.reset()
        self._inputs = list(tensors(inputs(x))) if self.g.build_output is not None else inputs(x)
        self._target = target

    def reset(self) -> None:
        """Drop everything held for the batch in flight."""
        self._env.clear()
        self._saved = [[] for _ in self.atoms]
        self._slices.clear()
        self._slice_leaf.clear()
        self._written.clear()
        self.output = self.loss = None

    # -- forward

    def _value(self, node: fx.Node) -> Any:
        return self._env[self.g.index[node]]

    def _arg(self, arg: Any) -> Any:
        return fx.node.map_arg(arg, self._value)

    def _run_node(self, i: int) -> None:
        node = self.g.nodes[i]
        op, target = node.op, node.target
        if op == "placeholder":
            at = sum(1 for n in self.g.nodes[:i] if n.op == "placeholder")
            if at < len(self._inputs):
                value: Any = self._inputs[at]
            elif node.args:
                value = node.args[0]
            else:
                raise ValueError(
                    f"the model's forward takes an input {target!r} the batch does not hold: give it a default,"
                    " or make the batch's input a tuple of all the inputs (the model is called as model(*x))"
                )
        elif op == "get_attr":
            value = self.g.model
            for name in str(target).split("."):
                value = getattr(value, name)
        elif op == "call_module":
            args, kwargs = self._arg(node.args), self._arg(node.kwargs)
            value = self.g.model.get_submodule(str(target))(*args, **kwargs)
        elif op == "call_function":
            args, kwargs = self._arg(node.args), self._arg(node.kwargs)
            assert callable(target)
            value = target(*args, **kwargs)
        elif op == "call_method":
            args, kwargs = self._arg(node.args), self._arg(node.kwargs)
            value = getattr(args[0], str(target))(*args[1:], **kwargs)
        elif op == "output":
            output = self._arg(node.args[0])
            self.output = output if self.g.build_output is None else self.g.build_output(output)
            if self.loss_fn is not None:
                self.loss = self.loss_fn(self.output, self._target)
            return
        else:
            raise ValueError(f"unknown fx node op {op!r}")
        self._env[i] = value

    def _forget(self, stop: int) -> None:
        """Drop values no node from ``stop`` on reads (their atoms' graphs keep what backward needs)."""
        for i in [i for i in self._env if self.g.last_use[i] < stop]:
            del self._env[i]

    def forward(self, k: int) -> None:
        """Run atom ``k``'s forward."""
        atom = self.atoms[k]
        if atom.is_slice:
            self._forward_slice(k, atom)
            return
        for i in range(atom.start, atom.stop):
            self._run_node(i)
        if self.grad:
            pairs = self._saved[k]
            for i in range(atom.start, min(atom.stop, len(self.g.nodes))):
                if i in self._env and self.g.last_use[i] >= atom.stop:
                    node = self.g.nodes[i]
                    clone = any(self.g.inplace(u) and u.args and u.args[0] is node for u in node.users)
                    self._env[i] = _detach(self._env[i], pairs, clone)
        self._forget(atom.stop)

    def _forward_slice(self, k: int, atom: Atom) -> None:
        i = atom.start
        node = self.g.nodes[i]
        module = _layer(self.g.module(i))
        (x,) = self._arg(node.args)
        lo, hi = _rows(atom, module)
        weight = module.weight.detach()[lo:hi]
        bias = None if module.bias is None else module.bias.detach()[lo:hi]
        if self.grad:
            weight.requires_grad_(module.weight.requires_grad)
            if bias is not None and module.bias is not None:
                bias.requires_grad_(module.bias.requires_grad)
        if isinstance(module, nn.Linear):
            out = F.linear(x, weight, bias)
        else:
            out = F.conv2d(x, weight, bias, module.stride, module.padding, module.dilation)
        parts = self._slices.setdefault(i, [])
        parts.append((out, weight, bias))
        if atom.part + 1 < atom.parts:
            return
        dim = -1 if isinstance(module, nn.Linear) else 1
        value = torch.cat([o.detach() for o, _, _ in parts], dim)
        if self.grad and any(o.requires_grad for o, _, _ in parts):
            value.requires_grad_()
            self._slice_leaf[i] = value
        clone = value.requires_grad and any(self.g.inplace(u) for u in node.users)
        self._env[i] = value.clone() if clone else value
        self._forget(i + 1)

    # -- backward

    def backward(self, k: int) -> None:
        """Run atom ``k``'s backward (after those of every later atom)."""
        atom = self.atoms[k]
        if atom.is_slice:
            self._backward_slice(atom)
            return
        outs: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        for tensor, leaf in self._saved[k]:
            if leaf.grad is not None and tensor.requires_grad:
                outs.append(tensor)
                grads.append(leaf.grad)
        if atom.stop >= len(self.g.nodes) and self.loss is not None:
            outs.append(self.loss)
            grads.append(None)
        self._saved[k] = []
        if outs:
            torch.autograd.backward(outs, grads)

    def _grad_buffer(self, param: torch.Tensor) -> torch.Tensor:
        """The storage of ``param``'s gradient this batch: last batch's, where it still fits."""
        buf = self._grad_buffers.get(id(param))
        if buf is None or buf.shape != param.shape or buf.dtype != param.dtype or buf.device != param.device:
            buf = self._grad_buffers[id(param)] = torch.empty_like(param)
        return buf

    def _backward_slice(self, atom: Atom) -> None:
        i = atom.start
        module = _layer(self.g.module(i))
        leaf = self._slice_leaf.get(i)
        parts = self._slices.get(i)
        if leaf is None or leaf.grad is None or not parts:
            return
        out, weight, bias = parts[atom.part]
        dim = -1 if isinstance(module, nn.Linear) else 1
        lo, hi = _rows(atom, module)
        if out.requires_grad:
            torch.autograd.backward([out], [leaf.grad.narrow(dim, lo, hi - lo)])
        for param, piece in ((module.weight, weight), (module.bias, bias)):
            if param is None or piece is None or piece.grad is None:
                continue
            if param.grad is None:
                # Not zeros_like: zero-filling the whole layer's gradient (411 MB for VGG-19's
                # first Linear) made the first slice's step 190 ms against 3 ms for the others.
                # The slices cover every row, each writes its own.
                param.grad = self._grad_buffer(param)
                self._written.add(id(param))
            if id(param) in self._written:
                param.grad[lo:hi].copy_(piece.grad)
            else:
                param.grad[lo:hi] += piece.grad
        parts[atom.part] = (out.detach(), weight, bias)  # the slice's graph is spent
