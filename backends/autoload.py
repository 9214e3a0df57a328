"""What ``freeride launch`` activates in every process of a training job.

Each framework adapter exposes ``on_import(module)``; this table says which
module triggers it. Adapters are imported lazily, so a job that never imports
DeepSpeed never imports FreeRide's DeepSpeed adapter either.
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

from freeride.backends import importhook

__all__ = ["HOOKS", "activate"]

logger = logging.getLogger(__name__)

HOOKS: dict[str, str] = {
    "deepspeed.runtime.pipe.engine": "freeride.backends.deepspeed",
    "megatron.core.pipeline_parallel.schedules": "freeride.backends.megatron",
    "torch.distributed.pipelining.schedules": "freeride.backends.torchpipe",
}
"""Framework module -> adapter package whose ``on_import`` patches it."""


def _lazy(adapter: str, trigger: str) -> importhook.PatchFn:
    def patch(module: ModuleType) -> None:
        importlib.import_module(adapter).on_import(module)

    patch.__name__ = f"patch_{trigger.replace('.', '_')}"
    return patch


def activate() -> None:
    """Register every adapter's import hook (idempotent)."""
    importhook.install()
    for trigger, adapter in HOOKS.items():
        importhook.register(trigger, _lazy(adapter, trigger))
