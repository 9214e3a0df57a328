"""Fixtures shared by the benchmarks' unit tests (import them into the test module).

The benchmark scripts and their harness live in tools/bench and import one
another as sibling modules; the fixtures import them the same way, with that
directory on sys.path. A plainly named module rather than a ``conftest.py``:
tests/ipc imports its own ``conftest`` by name, and a second one here would shadow it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

__all__ = ["fixture_harness", "fixture_mod", "fixture_report"]

BENCH_DIR = Path(__file__).resolve().parents[2] / "tools" / "bench"


@pytest.fixture(name="mod")
def fixture_mod(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """Imports a module of tools/bench by name."""
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module


@pytest.fixture(name="harness")
def fixture_harness(mod: Callable[[str], ModuleType]) -> ModuleType:
    """tools/bench/_pipeline_bench: the flags, the plan of runs, parsing and waiting on them."""
    return mod("_pipeline_bench")


@pytest.fixture(name="report")
def fixture_report(mod: Callable[[str], ModuleType]) -> ModuleType:
    """tools/bench/_bench_report: the runs' results and the tables rendered from them."""
    return mod("_bench_report")
