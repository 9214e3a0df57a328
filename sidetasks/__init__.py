"""Packaged sample side tasks.

Each registers under a short name in FreeRide's ``pyproject.toml`` (entry-point
groups ``freeride.tasks`` and ``freeride.programs``; see :mod:`freeride.tasks.targets`),
so nothing imports the samples to find them. :func:`describe` has a one-line
description of each.
"""

from __future__ import annotations

__all__ = ["DESCRIPTIONS", "describe"]

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
    "llm-generate": (
        "Greedy batch generation with a Hugging Face causal LM and a KV cache for a JSONL file of prompts;"
        " writes results as it goes, resumes after the last one written. Needs freeride-runtime[llm]."
    ),
    "llm-lora": (
        "LoRA fine-tuning of a Hugging Face causal LM (base frozen, adapters trained with AdamW) on a JSONL file"
        " of texts or token ids. Split automatically into steps under target_ms. Needs freeride-runtime[llm]."
    ),
    "llm-eval": (
        "Scores each new checkpoint the training job saves to a directory (watch=DIR): next-token loss and"
        " perplexity on held-out data, one batch per step; results to a JSONL file and metrics."
        " Needs freeride-runtime[llm]."
    ),
    "sweep-shard": "One shard of a sum-of-squares sweep (shard=I shards=N); writes OUT/shard-I.json when done.",
    "imaging-cli": "Plain resumable program (--out DIR --images N): edge maps of images; no FreeRide API.",
}
"""Short name (as registered) to a one-line description."""


def describe(name: str) -> str:
    """One line describing the sample ``name`` (a task or a program).

    Raises:
        KeyError: if ``name`` is unknown; the message lists the known names.
    """
    if name not in DESCRIPTIONS:
        raise KeyError(f"unknown side task {name!r}; known: {', '.join(DESCRIPTIONS)}")
    return DESCRIPTIONS[name]
