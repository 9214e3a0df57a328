"""The side-task catalog (registered by entry point), and that the samples use only FreeRide's public task API."""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from pathlib import Path

import pytest

import freeride.partition
import freeride.sidetask
from freeride.sidetask import IterativeTask
from freeride.sidetasks import DESCRIPTIONS, describe
from freeride.tasks.targets import catalog, program_command, programs

SAMPLES = Path(freeride.sidetasks.__file__).resolve().parent


@pytest.mark.parametrize("name", sorted(catalog()))
def test_every_task_resolves_and_is_described(name: str) -> None:
    module_name, _, cls_name = catalog()[name].partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    assert issubclass(cls, IterativeTask) and not inspect.isabstract(cls)
    assert cls.__doc__ and "Metrics" in cls.__doc__
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in inspect.signature(cls).parameters.values())
    line = describe(name)
    assert line and "\n" not in line


@pytest.mark.parametrize("name", sorted(programs()))
def test_every_program_resolves_and_is_described(name: str) -> None:
    module_name = programs()[name]
    assert program_command(name) == [sys.executable, "-m", module_name]
    assert callable(importlib.import_module(module_name).main)
    assert describe(name) and not set(programs()) & set(catalog())


def test_every_sample_is_registered_and_described() -> None:
    assert set(DESCRIPTIONS) == set(catalog()) | set(programs())


def test_every_iterative_task_class_is_listed() -> None:
    listed = set(catalog().values())
    for module_name in ("vision", "pagerank", "graph_sgd", "imaging", "transformer_lm", "mobilenet", "sweep"):
        module = importlib.import_module(f"freeride.sidetasks.{module_name}")
        for attr in module.__all__:
            obj = getattr(module, attr)
            if inspect.isclass(obj) and issubclass(obj, IterativeTask):
                assert f"{module.__name__}:{attr}" in listed


def test_unknown_name() -> None:
    with pytest.raises(KeyError, match="known: resnet18-train"):
        describe("nope")


def _freeride_imports(path: Path) -> set[tuple[str, str]]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("freeride"):
            found |= {(node.module, alias.name) for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {(alias.name, "") for alias in node.names if alias.name.startswith("freeride")}
    return found


@pytest.mark.parametrize("path", sorted(SAMPLES.glob("*.py")), ids=lambda p: p.name)
def test_samples_use_only_the_public_task_api(path: Path) -> None:
    for module, name in _freeride_imports(path):
        if module.startswith("freeride.sidetasks"):
            continue  # the samples' own private modules
        public = {"freeride.sidetask": freeride.sidetask.__all__, "freeride.partition": freeride.partition.__all__}
        assert name in public.get(module, ()), (module, name)


def test_the_imperative_sample_does_not_touch_freeride_at_all() -> None:
    imports = _freeride_imports(SAMPLES / "imaging_cli.py")
    assert imports and all(module.startswith("freeride.sidetasks._image") for module, _ in imports)


def test_a_source_tree_that_was_never_installed_reads_its_own_registrations(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a machine that puts the checkout on ``PYTHONPATH`` (tools/gpu/check.sh): no entry points, no metadata."""
    import importlib.metadata

    from freeride.tasks import targets

    def not_installed(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    installed = targets._registered(targets.TASKS_GROUP), targets._registered(targets.PROGRAMS_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    assert (targets._registered(targets.TASKS_GROUP), targets._registered(targets.PROGRAMS_GROUP)) == installed
