"""Packaged sample side tasks, and a catalog of them by short name.

:data:`CATALOG` maps a short name to an iterative task class as
``module:Class`` (built with keyword options). :data:`PROGRAMS` maps a short
name to the command line of a plain program that runs as an imperative task
(arguments follow it). :func:`describe` has a one-line description of each.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import zlib
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from freeride.sidetask import IterativeTask

__all__ = ["CATALOG", "DESCRIPTIONS", "PROGRAMS", "describe", "load", "resolve"]

CATALOG: dict[str, str] = {
    "resnet18-train": "sidetasks.vision:ResNet18Training",
    "resnet50-train": "sidetasks.vision:ResNet50Training",
    "vgg19-train": "sidetasks.vision:VGG19Training",
    "resnet18-infer": "sidetasks.vision:ResNet18Inference",
    "resnet50-infer": "sidetasks.vision:ResNet50Inference",
    "vgg19-infer": "sidetasks.vision:VGG19Inference",
    "pagerank": "sidetasks.pagerank:PageRank",
    "graph-sgd": "sidetasks.graph_sgd:GraphSGD",
    "imaging": "sidetasks.imaging:ImageProcessing",
    "transformer-lm": "sidetasks.transformer_lm:TransformerLMTraining",
    "mobilenet-train": "sidetasks.mobilenet:MobileNetV2Training",
    "sweep-shard": "sidetasks.sweep:SweepShard",
}
"""Short name to ``module:Class`` of an iterative task."""

PROGRAMS: dict[str, tuple[str, ...]] = {
    "imaging-cli": ("python", "-m", "sidetasks.imaging_cli"),
}
"""Short name to the command (before its own arguments) of an imperative sample program.

``"python"`` stands for the interpreter FreeRide itself runs under (``sys.executable``).
"""

DESCRIPTIONS: dict[str, str] = {
    "resnet18-train": (
        "Train ResNet-18 with SGD on synthetic or folder images; reports loss."
        " Split automatically into steps under target_ms."
    ),
    "resnet50-train": (
        "Train ResNet-50 with SGD on synthetic or folder images; reports loss."
        " Split automatically into steps under target_ms."
    ),
    "vgg19-train": (
        "Train VGG-19 with SGD on synthetic or folder images; reports loss."
        " Split automatically into steps under target_ms."
    ),
    "resnet18-infer": "Batch inference with ResNet-18 on held-out images; reports images/s and top-1.",
    "resnet50-infer": "Batch inference with ResNet-50 on held-out images; reports images/s and top-1.",
    "vgg19-infer": "Batch inference with VGG-19 on held-out images; reports images/s and top-1.",
    "pagerank": "PageRank by sparse power iteration on a generated or edge-list graph; reports residual.",
    "graph-sgd": "Matrix factorisation by SGD over rating-graph edges; reports train/test RMSE.",
    "imaging": "Histogram equalisation, Gaussian blur and Sobel edges over image batches.",
    "transformer-lm": (
        "Train a small causal transformer LM (nn.TransformerEncoder) on bytes of text with AdamW; reports loss."
        " Split automatically into steps under target_ms."
    ),
    "mobilenet-train": (
        "Train MobileNetV2 with SGD on synthetic images; reports loss. Split automatically into steps under target_ms."
    ),
    "sweep-shard": "One shard of a sum-of-squares sweep (shard=I shards=N); writes OUT/shard-I.json when done.",
    "imaging-cli": "Plain resumable program (--out DIR --images N): edge maps of images; no FreeRide API.",
}
"""Short name (of :data:`CATALOG` or :data:`PROGRAMS`) to a one-line description."""


def describe(name: str) -> str:
    """One line describing the sample ``name`` (a task or a program).

    Raises:
        KeyError: if ``name`` is unknown; the message lists the known names.
    """
    if name not in DESCRIPTIONS:
        raise KeyError(f"unknown side task {name!r}; known: {', '.join(DESCRIPTIONS)}")
    return DESCRIPTIONS[name]


def resolve(name: str) -> str:
    """The canonical target of an iterative task, however it is named.

    The one place names are resolved: the CLI, the demo, the catalog, the
    manager's check at submit and the worker all call it, so a name accepted
    by one is accepted by all. Accepted: a catalog name (``pagerank``), a
    catalog name with its class (``pagerank:PageRank``), ``module:Class``
    (``sidetasks.pagerank:PageRank``; ``freeride.sidetasks.x:Y``, the samples'
    name before 0.2, still works) and ``path/to/file.py:Class`` (made absolute
    here: a worker runs in its own directory).

    Returns:
        ``module:Class``, or ``/absolute/file.py:Class``.

    Raises:
        ValueError: ``name`` is none of these.
    """
    name = name.strip()
    if name in CATALOG:
        return CATALOG[name]
    module, sep, cls = name.rpartition(":")
    if not sep:
        raise ValueError(
            f"unknown side task {name!r}: give a catalog name ({', '.join(CATALOG)}), module:Class"
            " or path/file.py:Class (freeride submit --list shows the catalog)"
        )
    if not cls.isidentifier():
        raise ValueError(f"side task {name!r}: {cls!r} is not a class name")
    if module.endswith(".py"):
        return f"{os.path.abspath(os.path.expanduser(module))}:{cls}"
    if module in CATALOG:
        module = CATALOG[module].partition(":")[0]
    if not all(part.isidentifier() for part in module.split(".")):
        raise ValueError(f"side task {name!r} is not of the form module:Class or path/file.py:Class")
    if module.startswith("freeride.sidetasks."):
        module = module.removeprefix("freeride.")
    return f"{module}:{cls}"


def load(name: str) -> type[IterativeTask]:
    """Import the task ``name`` (anything :func:`resolve` accepts) and check it is an ``IterativeTask``.

    Raises:
        ValueError: ``name`` is not a task name.
        ImportError: its module or file cannot be imported.
        TypeError: what it names is not a subclass of ``freeride.IterativeTask``.
    """
    from freeride.sidetask import IterativeTask

    target = resolve(name)
    module_name, _, cls_name = target.rpartition(":")
    is_file = module_name.endswith(".py")
    module = _import_file(Path(module_name)) if is_file else importlib.import_module(module_name)
    obj = getattr(module, cls_name, None)
    if not (isinstance(obj, type) and issubclass(obj, IterativeTask)):
        raise TypeError(f"{target} is not a subclass of freeride.IterativeTask")
    return obj


def _import_file(path: Path) -> ModuleType:
    """Import a task's own file as a module of its own (registered: pickling and dataclasses look it up)."""
    module_name = f"freeride_task_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
