"""Packaged sample side tasks, and a catalog of them by short name.

:data:`CATALOG` maps a short name to an iterative task class as
``module:Class`` (built with keyword options). :data:`PROGRAMS` maps a short
name to the command line of a plain program that runs as an imperative task
(arguments follow it). :func:`describe` has a one-line description of each.
"""

from __future__ import annotations

__all__ = ["CATALOG", "DESCRIPTIONS", "PROGRAMS", "describe"]

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
}
"""Short name to ``module:Class`` of an iterative task."""

PROGRAMS: dict[str, tuple[str, ...]] = {
    "imaging-cli": ("python", "-m", "freeride.sidetasks.imaging_cli"),
}
"""Short name to the command (before its own arguments) of an imperative sample program.

``"python"`` stands for the interpreter FreeRide itself runs under (``sys.executable``).
"""

DESCRIPTIONS: dict[str, str] = {
    "resnet18-train": (
        "Train ResNet-18 with SGD on synthetic or folder images; reports loss."
        " Options micro_batch_size and layer_steps split its steps."
    ),
    "resnet50-train": (
        "Train ResNet-50 with SGD on synthetic or folder images; reports loss."
        " Options micro_batch_size and layer_steps split its steps."
    ),
    "vgg19-train": (
        "Train VGG-19 with SGD on synthetic or folder images; reports loss."
        " Options micro_batch_size and layer_steps split its steps."
    ),
    "resnet18-infer": "Batch inference with ResNet-18 on held-out images; reports images/s and top-1.",
    "resnet50-infer": "Batch inference with ResNet-50 on held-out images; reports images/s and top-1.",
    "vgg19-infer": "Batch inference with VGG-19 on held-out images; reports images/s and top-1.",
    "pagerank": "PageRank by sparse power iteration on a generated or edge-list graph; reports residual.",
    "graph-sgd": "Matrix factorisation by SGD over rating-graph edges; reports train/test RMSE.",
    "imaging": "Histogram equalisation, Gaussian blur and Sobel edges over image batches.",
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
