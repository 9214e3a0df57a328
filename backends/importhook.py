"""Patch a framework module right after it is imported, without touching user code.

``freeride launch`` puts a ``sitecustomize`` on ``PYTHONPATH`` that calls
:func:`freeride.backends.autoload.activate`, which registers one patch per
framework module here. When the training script (or the framework itself)
imports that module, the patch runs on the freshly executed module, before
anything else can use it. Modules already imported are patched at once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

__all__ = ["PatchFn", "install", "register", "uninstall"]

logger = logging.getLogger(__name__)

PatchFn = Callable[[ModuleType], None]

_patches: dict[str, PatchFn] = {}


def _apply(name: str, module: ModuleType) -> None:
    patch = _patches.get(name)
    if patch is None or getattr(module, "__freeride_patched__", False):
        return
    try:
        patch(module)
        setattr(module, "__freeride_patched__", True)  # noqa: B010 - a flag on a foreign module
        logger.debug("[attach] patched %s", name)
    except Exception:  # a broken patch must not break the training script
        logger.exception("[attach] could not patch %s; training continues without FreeRide", name)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _apply(self._name, module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Loader(spec.loader, fullname)
                return spec
        return None


_finder = _Finder()


def register(module_name: str, patch: PatchFn) -> None:
    """Run ``patch(module)`` once ``module_name`` has been imported."""
    _patches[module_name] = patch
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        _apply(module_name, loaded)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent)."""
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    """Remove the finder and forget registered patches (for tests)."""
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _patches.clear()
