"""Packaged sample side tasks, and a catalog of them by short name.

Each entry of :data:`CATALOG` names an iterative task class
(``module:Class``, built with keyword options) or, for ``imaging-cli``, a
plain program run as an imperative task (``python -m module``).
"""

from __future__ import annotations

__all__ = ["CATALOG", "DESCRIPTIONS", "IMPERATIVE", "describe"]

CATALOG: dict[str, str] = {
    "resnet18-train": "freeride.sidetasks.vision:ResNet18Training",
    "resnet50-train": "freeride.sidetasks.vision:ResNet50Training",
    "vgg19-train": "freeride.sidetasks.vision:VGG19Training",
    "resnet18-infer": "freeride.sidetasks.vision:ResNet18Inference",
    "resnet50-infer": "freeride.sidetasks.vision:ResNet50Inference",
    "vgg19-infer": "freeride.sidetasks.vision:VGG19Inference",
    "pagerank": "freeride.sidetasks.pagerank:PageRank",
    "graph-sgd": "freeride.sidetasks.graph_sgd:GraphSGD",
    "imaging": "freeride.sidetasks.imaging:ImageProcessing",
    "imaging-cli": "freeride.sidetasks.imaging_cli",
}
"""Short name to target: ``module:Class`` for iterative tasks, a module for imperative ones."""

IMPERATIVE: frozenset[str] = frozenset({"imaging-cli"})
"""Catalog names whose target is a program (``python -m <target> ...``), not a task class."""

DESCRIPTIONS: dict[str, str] = {
    "resnet18-train": "Train ResNet-18 with SGD on synthetic or folder images; reports loss.",
    "resnet50-train": "Train ResNet-50 with SGD on synthetic or folder images; reports loss.",
    "vgg19-train": "Train VGG-19 with SGD on synthetic or folder images; reports loss.",
    "resnet18-infer": "Batch inference with ResNet-18 on held-out images; reports images/s and top-1.",
    "resnet50-infer": "Batch inference with ResNet-50 on held-out images; reports images/s and top-1.",
    "vgg19-infer": "Batch inference with VGG-19 on held-out images; reports images/s and top-1.",
    "pagerank": "PageRank by sparse power iteration on a generated or edge-list graph; reports residual.",
    "graph-sgd": "Matrix factorisation by SGD over rating-graph edges; reports train/test RMSE.",
    "imaging": "Histogram equalisation, Gaussian blur and Sobel edges over image batches.",
    "imaging-cli": "Plain resumable program: edge maps of images (--out DIR --images N); no FreeRide API.",
}
"""Short name to a one-line description."""


def describe(name: str) -> str:
    """One line describing the catalog entry ``name``.

    Raises:
        KeyError: if ``name`` is not in :data:`CATALOG`, listing the known names.
    """
    if name not in CATALOG:
        raise KeyError(f"unknown side task {name!r}; known: {', '.join(CATALOG)}")
    return DESCRIPTIONS[name]
