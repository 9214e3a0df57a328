"""How a side task's name resolves to the class or program it means.

Tasks are registered by entry point, so the runtime never imports a task to
know its name: the group ``freeride.tasks`` maps a short name to an iterative
task class (``name = "module:Class"``), the group ``freeride.programs`` a short
name to a module run as a plain program (``python -m module``, an imperative
task). FreeRide's samples (:mod:`freeride.sidetasks`) register themselves there
in FreeRide's own ``pyproject.toml``; any installed package can add its own.

A source tree on ``PYTHONPATH`` that was never installed has no entry points:
its ``pyproject.toml`` is read instead.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import tomllib
import zlib
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from freeride.sidetask import IterativeTask

__all__ = ["catalog", "load", "program_command", "programs", "resolve"]

TASKS_GROUP = "freeride.tasks"
PROGRAMS_GROUP = "freeride.programs"
DISTRIBUTION = "freeride-runtime"
_OLD_SAMPLES = "sidetasks."
"""The samples' module prefix before they installed under ``freeride.``: still accepted."""


def _registered(group: str) -> dict[str, str]:
    """``name -> value`` of the entry points of ``group`` (first registration of a name wins)."""
    found: dict[str, str] = {}
    for ep in importlib.metadata.entry_points(group=group):
        found.setdefault(ep.name, ep.value)
    if found:
        return found
    try:  # not installed: this source tree's own registrations
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        if pyproject.is_file():
            entry_points = tomllib.loads(pyproject.read_text())["project"].get("entry-points", {})
            return dict(entry_points.get(group, {}))
    return found


@functools.cache
def catalog() -> dict[str, str]:
    """Short name to ``module:Class`` of every registered iterative task."""
    return _registered(TASKS_GROUP)


@functools.cache
def programs() -> dict[str, str]:
    """Short name to the module of every registered plain program."""
    return _registered(PROGRAMS_GROUP)


def program_command(name: str) -> list[str]:
    """The command line (before its own arguments) that runs the registered program ``name``.

    Raises:
        KeyError: no program is registered under ``name``.
    """
    return [sys.executable, "-m", programs()[name]]


def resolve(name: str) -> str:
    """The canonical target of an iterative task, however it is named.

    The one place names are resolved: the CLI, the demo, the manager's check at
    submit and the worker all call it, so a name accepted by one is accepted by
    all. Accepted: a catalog name (``pagerank``), a catalog name with its class
    (``pagerank:PageRank``), ``module:Class`` (``freeride.sidetasks.pagerank:PageRank``;
    ``sidetasks.pagerank:PageRank`` still works) and ``path/to/file.py:Class``
    (made absolute here: a worker runs in its own directory).

    Returns:
        ``module:Class``, or ``/absolute/file.py:Class``.

    Raises:
        ValueError: ``name`` is none of these.
    """
    name = name.strip()
    known = catalog()
    if name in known:
        return known[name]
    module, sep, cls = name.rpartition(":")
    if not sep:
        close = difflib.get_close_matches(name, [*known, *programs()], n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(
            f"unknown side task {name!r}: {hint}give a catalog name ({', '.join(known) or 'none registered'}),"
            " module:Class or path/file.py:Class (freeride submit --list shows the catalog)"
        )
    if not cls.isidentifier():
        raise ValueError(f"side task {name!r}: {cls!r} is not a class name")
    if module.endswith(".py"):
        return f"{os.path.abspath(os.path.expanduser(module))}:{cls}"
    if module in known:
        module = known[module].partition(":")[0]
    if not all(part.isidentifier() for part in module.split(".")):
        raise ValueError(f"side task {name!r} is not of the form module:Class or path/file.py:Class")
    if module.startswith(_OLD_SAMPLES):
        module = "freeride." + module
    return f"{module}:{cls}"


def load(name: str) -> type[IterativeTask]:
    """Import the task ``name`` (anything :func:`resolve` accepts) and check it is an ``IterativeTask``.

    Raises:
        ValueError: ``name`` is not a task name, or names a file that does not exist or does not parse.
        ImportError: its module or file cannot be imported.
        TypeError: what it names is not a subclass of ``freeride.IterativeTask``.
    """
    from freeride.sidetask import IterativeTask

    target = resolve(name)
    module_name, _, cls_name = target.rpartition(":")
    is_file = module_name.endswith(".py")
    module = _import_file(Path(module_name)) if is_file else importlib.import_module(module_name)
    obj = getattr(module, cls_name, None)
    if obj is None:
        raise TypeError(f"{target}: {module_name} has no {cls_name!r}")
    if not (isinstance(obj, type) and issubclass(obj, IterativeTask)):
        raise TypeError(f"{target} is not a subclass of freeride.IterativeTask")
    return obj


def _import_file(path: Path) -> ModuleType:
    """Import a task's own file as a module of its own (registered: pickling and dataclasses look it up)."""
    module_name = f"freeride_task_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    if not path.is_file():
        raise ValueError(f"side task file {path} does not exist")
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[module_name]
        raise ValueError(f"{exc.filename}:{exc.lineno}: {exc.msg}") from None
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
