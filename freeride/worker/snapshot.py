"""A consistent host copy of a task's state, taken a slice at a time, and its write in the background.

A state too large to save inside a bubble (a model with its optimizer's
buffers: hundreds of MB) is copied into host memory in slices, each sized to
what is left of a grant; no step of the task runs until the copy is whole, so
the copy is the state at one step count. A thread then writes the copy while
the task's steps go on; the task's own tensors are never read again by it.

Tensors (any device) and numpy arrays are copied slice by slice; containers
(dicts, lists, tuples, named tuples) are rebuilt around the copies; any other
value is copied whole when the copy begins.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["StateCopy", "StateWriter", "WriteState"]

WriteState = Callable[[object, Path, int], None]
"""Writes a state with its step count to a path (:func:`~freeride.worker.checkpoint.write_checkpoint`)."""


class _Leaf:
    """One tensor or array: its source, and its host copy as far as it goes."""

    __slots__ = ("done", "dst", "itemsize", "size", "src")

    def __init__(self, src: Any) -> None:
        self.src = src
        self.dst: Any = None
        self.done = 0
        """Elements copied so far."""
        self.itemsize = int(src.itemsize) if hasattr(src, "itemsize") else int(src.element_size())
        self.size = int(src.numel()) if hasattr(src, "numel") else int(src.size)

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize

    def copy(self, max_bytes: int) -> int:
        """Copy up to ``max_bytes`` more (at least one element); the bytes copied."""
        torch = sys.modules.get("torch")
        with contextlib.nullcontext() if torch is None else torch.no_grad():
            if not _flat(self.src):  # no flat view to slice: copied in one go
                self.dst, self.done = _whole_copy(self.src), self.size
                return self.nbytes
            if self.dst is None:
                self.dst = _host_like(self.src)
            n = min(self.size - self.done, max(1, max_bytes // max(1, self.itemsize)))
            lo, hi = self.done, self.done + n
            self.dst.reshape(-1)[lo:hi] = self.src.reshape(-1)[lo:hi]
        self.done = hi
        return n * self.itemsize


def _is_tensor(value: object) -> bool:
    torch = sys.modules.get("torch")  # a state holds tensors only where torch is loaded
    return torch is not None and isinstance(value, torch.Tensor)


def _is_array(value: object) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


def _flat(value: Any) -> bool:
    """Whether ``value`` has a flat view sharing its memory (dense and contiguous)."""
    if _is_tensor(value):
        return bool(value.layout == sys.modules["torch"].strided and value.is_contiguous())
    return bool(value.flags.c_contiguous)


def _whole_copy(value: Any) -> Any:
    """A host copy of ``value`` made in one go (strided views, sparse layouts)."""
    if _is_tensor(value):
        return value.detach().to("cpu", copy=True)
    return value.copy()


def _host_like(value: Any) -> Any:
    """An uninitialised host buffer of a flat ``value``'s shape and type.

    Pageable, also for a device tensor: its pages are mapped as slices reach
    them, while pinning hundreds of MB would take one slice far past its room.
    """
    if _is_tensor(value):
        return sys.modules["torch"].empty(value.shape, dtype=value.dtype, device="cpu")
    return sys.modules["numpy"].empty(value.shape, dtype=value.dtype)


class StateCopy:
    """A task's state copied to host memory, slice by slice.

    Args:
        state: What the task's ``state_dict()`` returned. Its tensors and
            arrays must not change until :attr:`done` (no step runs meanwhile).
    """

    def __init__(self, state: object) -> None:
        self._leaves: list[_Leaf] = []
        self._seen: dict[int, _Leaf] = {}
        self._next = 0
        """The first leaf not wholly copied."""
        self.copied = 0
        """Bytes copied so far."""
        self.state = self._rebuild(state)
        """The copy: ``state``'s structure with host buffers where its tensors and arrays were."""
        self.total = sum(leaf.nbytes for leaf in self._leaves)
        """Bytes of tensor and array data to copy."""

    def _rebuild(self, value: object) -> object:
        if _is_tensor(value) or _is_array(value):
            leaf = self._seen.get(id(value))
            if leaf is None:  # the same tensor twice (tied weights) is copied, and saved, once
                leaf = self._seen[id(value)] = _Leaf(value)
                self._leaves.append(leaf)
            return _Placeholder(leaf)
        if isinstance(value, dict):
            out: dict[Any, Any] = OrderedDict() if isinstance(value, OrderedDict) else {}
            for key, item in value.items():
                out[key] = self._rebuild(item)
            metadata = getattr(value, "_metadata", None)  # a module's state_dict carries its versions
            if metadata is not None:
                out._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
            return out
        if isinstance(value, list):
            return [self._rebuild(item) for item in value]
        if isinstance(value, tuple):
            return _tuple_like(value, [self._rebuild(item) for item in value])
        return copy.deepcopy(value)

    @property
    def done(self) -> bool:
        return self._next >= len(self._leaves)

    def copy(self, max_bytes: int) -> int:
        """Copy up to ``max_bytes`` more (at least one element unless done); the bytes copied."""
        copied = 0
        while not self.done and copied < max_bytes:
            leaf = self._leaves[self._next]
            copied += leaf.copy(max_bytes - copied)
            if leaf.done >= leaf.size:
                self._next += 1
        self.copied += copied
        return copied

    def result(self) -> object:
        """The copied state, once :attr:`done`, with every placeholder replaced by its host buffer."""
        if not self.done:
            raise RuntimeError("the state is not wholly copied yet")
        return _fill(self.state)


def _tuple_like(value: tuple[Any, ...], items: list[object]) -> tuple[Any, ...]:
    """``items`` as a tuple of ``value``'s type: a named tuple stays one."""
    kind: Any = type(value)
    return kind(*items) if hasattr(value, "_fields") else tuple(items)


class _Placeholder:
    __slots__ = ("leaf",)

    def __init__(self, leaf: _Leaf) -> None:
        self.leaf = leaf


def _fill(value: object) -> object:
    if isinstance(value, _Placeholder):
        return value.leaf.dst
    if isinstance(value, dict):
        for key, item in value.items():
            value[key] = _fill(item)
        return value
    if isinstance(value, list):
        return [_fill(item) for item in value]
    if isinstance(value, tuple):
        return _tuple_like(value, [_fill(item) for item in value])
    return value


class StateWriter:
    """Writes a copied state on a thread of its own, while the task steps on.

    The thread inherits the worker's core and lowest priority. A failure is
    kept and read once the thread is done; it never ends the task.

    Args:
        write: Writes the state (see :data:`WriteState`).
        state: The copied state; only this thread reads it from now on.
        path: Where the checkpoint goes.
        steps: The step count the state is at.
        began_ns: When the copy began: the checkpoint's age counts from there.
    """

    def __init__(self, write: WriteState, state: object, path: Path, *, steps: int, began_ns: int) -> None:
        self.steps, self.began_ns, self.path = steps, began_ns, path
        self.error = ""
        """What went wrong (empty: the write succeeded, once done)."""
        self._thread = threading.Thread(
            target=self._run, args=(write, state), name=f"freeride-checkpoint-{steps}", daemon=True
        )
        self._thread.start()

    def _run(self, write: WriteState, state: object) -> None:
        try:
            write(state, self.path, self.steps)
        except Exception as exc:  # kept for the task's thread: reported there, and tried again later
            self.error = f"{type(exc).__name__}: {exc}"

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
