"""The values that cross piece boundaries: their tensors found and replaced, every container kept as its type.

A model's output, and what one piece hands the next, may be a tensor or any
nesting of tuples, named tuples, lists, dicts (``OrderedDict``, a Hugging Face
``ModelOutput``) and dataclasses. :func:`rebuild` maps the values inside and
builds each container again as the type it was, so ``out.logits`` and
``out[0]`` read in a later piece what they read in the plain model. A
container nothing inside of which changed is handed on as it is; any other
object is a value of its own, not looked into.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["flatten", "inputs", "rebuild", "tensors"]


def rebuild(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``value`` with every value that is no container replaced by ``fn(value)``, its containers' types kept."""
    if isinstance(value, tuple | list):
        items = [rebuild(v, fn) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple takes its fields one by one
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        mapped = {k: rebuild(v, fn) for k, v in value.items()}
        if all(mapped[k] is v for k, v in value.items()):
            return value
        if type(value) is dict:
            return mapped
        if dataclasses.is_dataclass(value):  # a ModelOutput: its own constructor sets keys and attributes
            return type(value)(**mapped)
        out = copy.copy(value)  # an OrderedDict, a defaultdict: keeps what the constructor took
        for k, v in mapped.items():
            out[k] = v
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        init = {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
        changed = {k: rebuild(v, fn) for k, v in init.items()}
        if all(changed[k] is v for k, v in init.items()):
            return value
        return dataclasses.replace(value, **changed)
    return fn(value)


def tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value``, depth first, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors(v)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from tensors(getattr(value, f.name))


def inputs(x: Any) -> list[Any]:
    """The arguments a model is called with for the batch input ``x``: ``model(*x)`` for a tuple, else ``model(x)``."""
    return list(x) if type(x) is tuple else [x]


class _Slot:
    """Where the ``index``-th tensor of a flattened value was."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


_CONSTANTS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def flatten(value: Any) -> tuple[list[torch.Tensor], Callable[[Sequence[Any]], Any], list[str]]:
    """``value``'s tensors, a function building ``value`` again around other tensors, and what it leaves out.

    Numbers, strings and ``None`` are kept as they are; any other object (a
    key-value cache, say) becomes ``None``: its type is named in the third item.
    """
    leaves: list[torch.Tensor] = []
    dropped: list[str] = []

    def slot(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            leaves.append(v)
            return _Slot(len(leaves) - 1)
        if isinstance(v, _CONSTANTS):
            return v
        dropped.append(type(v).__name__)
        return None

    template = rebuild(value, slot)

    def build(values: Sequence[Any]) -> Any:
        return rebuild(template, lambda v: values[v.index] if isinstance(v, _Slot) else v)

    return leaves, build, dropped
