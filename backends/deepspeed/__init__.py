"""DeepSpeed pipeline-parallel backend: bubble events from ``PipelineEngine``.

Two ways in, neither of which changes how the model trains:

* ``freeride launch -- deepspeed train.py ...`` (or ``torchrun``): the launcher's
  import hook calls :func:`on_import` when ``deepspeed.runtime.pipe.engine`` is
  imported, and every pipeline engine of the job is watched from its first batch.
* One line in the script, after ``deepspeed.initialize``::

      handle = freeride.backends.deepspeed.attach(engine)

Without a manager listening, training runs as it would without FreeRide.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from freeride.backends.deepspeed import _compat
from freeride.backends.deepspeed.adapter import DeepSpeedAdapter
from freeride.backends.watched import Watched

__all__ = ["DeepSpeedAdapter", "attach", "attached", "on_import"]

logger = logging.getLogger(__name__)

_ENGINE_MODULE = "deepspeed.runtime.pipe.engine"

_watched: Watched[DeepSpeedAdapter] = Watched(DeepSpeedAdapter, what="DeepSpeed engine")
_auto = False
"""Watch every engine (set by the import hook), not only attached ones."""


def _wrap_exec_schedule(original: _compat.ExecSchedule) -> _compat.ExecSchedule:
    def _exec_schedule(engine: Any, pipe_schedule: Any) -> Any:
        adapter = _watched.watch(engine, create=_auto)
        if adapter is None:
            return original(engine, pipe_schedule)
        return adapter.run_schedule(original, engine, pipe_schedule)

    return _exec_schedule


def _wrap_aggregate_loss(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def _aggregate_total_loss(engine: Any) -> Any:
        adapter = _watched.live(engine)
        if adapter is None:
            return original(engine)
        return adapter.run_aggregate_loss(original, engine)

    return _aggregate_total_loss


def _patch(module: ModuleType) -> bool:
    return _compat.patch_pipeline_engine(module, exec_schedule=_wrap_exec_schedule, aggregate_loss=_wrap_aggregate_loss)


def on_import(module: ModuleType) -> None:
    """Import hook for ``deepspeed.runtime.pipe.engine``: watch every pipeline engine.

    Never raises: on any problem it logs and leaves DeepSpeed as it was.
    """
    global _auto
    try:
        if _patch(module):
            _auto = True
    except Exception:
        logger.exception("[attach] cannot patch %s; training continues without FreeRide", module.__name__)


def attach(engine: Any, **options: Any) -> DeepSpeedAdapter:
    """Watch ``engine`` (a DeepSpeed ``PipelineEngine``) and emit its bubbles.

    Idempotent: attaching an engine twice returns the same handle. ``handle.close()``
    stops watching it.

    Args:
        engine: What ``deepspeed.initialize`` returned for a ``PipelineModule``.
        **options: Passed to :class:`DeepSpeedAdapter` (``session``, ``mode``,
            ``profile_dir``, ``min_bubble_ns``).

    Raises:
        TypeError: ``engine`` is not a pipeline engine.
        RuntimeError: This DeepSpeed version lacks the methods the adapter hooks.
    """
    module = importlib.import_module(_ENGINE_MODULE)
    if not isinstance(engine, module.PipelineEngine):
        raise TypeError(f"engine must be a DeepSpeed PipelineEngine, got {type(engine).__name__}")
    if not _patch(module):
        raise RuntimeError(f"DeepSpeed {_compat.deepspeed_version()}: cannot hook PipelineEngine")
    return _watched.attach(engine, lambda: DeepSpeedAdapter(engine, **options))


def attached(engine: Any) -> DeepSpeedAdapter | None:
    """The live handle watching ``engine``, if any."""
    return _watched.live(engine)
