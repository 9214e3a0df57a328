"""Modules loaded from files of the repository: the CUDA stand-ins and the tools are not packages."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

__all__ = ["load"]

ROOT = Path(__file__).resolve().parents[2]


def load(relative: str, name: str) -> ModuleType:
    """The file ``relative`` (to the repository's root) as a module named ``name`` (one copy per name)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
