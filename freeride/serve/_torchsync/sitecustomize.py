"""Bound the CUDA work a stopped PyTorch program leaves queued.

Loaded at start-up of a side-task program whose ``PYTHONPATH`` starts with this
directory. With ``FREERIDE_SYNC_EVERY=K`` (K > 0) it registers, once
``torch.optim.optimizer`` is imported, a global optimizer step hook that calls
``torch.cuda.synchronize()`` after every K-th ``Optimizer.step`` call of the
process. When the program is stopped with ``SIGSTOP``, kernels it already queued
keep running on the GPU; with the hook at most about K steps of kernels are
queued at any time, which bounds that tail.

The hook does nothing until the program has initialised CUDA, so CPU-only
programs are unaffected. Importing this module never imports torch: programs
that do not use torch pay one ``sys.meta_path`` lookup per import. Any other
``sitecustomize`` on ``sys.path`` is loaded after this one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__: list[str] = []

_TARGET = "torch.optim.optimizer"


def _every() -> int:
    try:
        return max(0, int(os.environ.get("FREERIDE_SYNC_EVERY", "0")))
    except ValueError:
        return 0


def _register(module: ModuleType, every: int) -> None:
    steps = itertools.count(1)

    def sync_hook(optimizer: object, args: object, kwargs: object) -> None:
        if next(steps) % every:
            return
        cuda = sys.modules["torch"].cuda
        if cuda.is_initialized():
            cuda.synchronize()

    module.register_optimizer_step_post_hook(sync_hook)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, every: int) -> None:
        self._inner, self._every = inner, every

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _register(module, self._every)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, every: int) -> None:
        self._every = every

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, self._every)
        return spec


def _chain_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    saved_path, ours = sys.path[:], sys.modules.pop("sitecustomize", None)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
        importlib.import_module("sitecustomize")
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = saved_path
        if ours is not None:
            sys.modules["sitecustomize"] = ours


def _install() -> None:
    every = _every()
    if every and _TARGET not in sys.modules:
        sys.meta_path.insert(0, _Finder(every))
    _chain_next_sitecustomize()


_install()
