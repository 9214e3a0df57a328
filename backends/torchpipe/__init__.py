"""torch.distributed.pipelining backend: bubble events from PyTorch's own pipeline schedules.

``freeride launch -- torchrun ... train.py``: the launcher's import hook calls
:func:`on_import` when ``torch.distributed.pipelining.schedules`` is imported
(``import torch.distributed.pipelining`` does), and every schedule object of
the job (``Schedule1F1B``, ``ScheduleGPipe``, ``ScheduleInterleaved1F1B``,
``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``)
is watched from its first ``step()``; ``eval()`` runs untouched. The training
script does not change.

Without a manager listening, training runs as it would without FreeRide.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from freeride.backends.schedule import Kind
from freeride.backends.torchpipe import _compat
from freeride.backends.torchpipe.adapter import TorchPipeAdapter
from freeride.backends.watched import Watched

__all__ = ["TorchPipeAdapter", "attached", "on_import"]

logger = logging.getLogger(__name__)

_watched: Watched[TorchPipeAdapter] = Watched(TorchPipeAdapter, what="pipeline schedule")


class _Current(threading.local):
    adapter: TorchPipeAdapter | None = None
    """The adapter whose ``step()`` runs on this thread (p2p and compute hooks report to it)."""


_current = _Current()


def _wrap_step(original: _compat.StepFn) -> _compat.StepFn:
    def step(schedule: Any, *args: Any, **kwargs: Any) -> Any:
        if _current.adapter is not None:  # a schedule run from inside another step: leave it alone
            return original(schedule, *args, **kwargs)
        adapter = _watched.watch(schedule)
        if adapter is None:
            return original(schedule, *args, **kwargs)
        _current.adapter = adapter
        try:
            return adapter.run_step(original, schedule, args, kwargs)
        finally:
            _current.adapter = None

    return step


def _wrap_batch_p2p(original: _compat.BatchP2P) -> _compat.BatchP2P:
    def _batch_p2p(p2p_ops: list[Any], *args: Any, **kwargs: Any) -> list[Any]:
        works = original(p2p_ops, *args, **kwargs)
        adapter = _current.adapter
        if adapter is not None:
            adapter._track(adapter.posted, p2p_ops, works)
        return works

    return _batch_p2p


def _wrap_wait(original: _compat.WaitBatchP2P) -> _compat.WaitBatchP2P:
    def _wait_batch_p2p(work: list[Any]) -> None:
        adapter = _current.adapter
        if adapter is None:
            original(work)
        else:
            adapter.wait(original, work)

    return _wait_batch_p2p


def _wrap_compute(kind: str, original: Callable[..., Any]) -> Callable[..., Any]:
    pass_kind: Kind = "F" if kind == "F" else "B" if kind == "B" else "W"

    def compute(*args: Any, **kwargs: Any) -> Any:
        adapter = _current.adapter
        if adapter is None:
            return original(*args, **kwargs)
        return adapter.compute(pass_kind, original, args, kwargs)

    compute.__name__ = getattr(original, "__name__", "compute")
    compute.__doc__ = getattr(original, "__doc__", None)
    return compute


def _wrap_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    def perform_reduce_grad(*args: Any, **kwargs: Any) -> Any:
        adapter = _current.adapter
        if adapter is None:
            return original(*args, **kwargs)
        return adapter.sync(original, args, kwargs)

    perform_reduce_grad.__doc__ = getattr(original, "__doc__", None)
    return perform_reduce_grad


def on_import(module: ModuleType) -> None:
    """Import hook for ``torch.distributed.pipelining.schedules``: watch every schedule's steps.

    Never raises: on any problem (this torch is too old, or lacks a name the
    backend needs) it logs why, in one line, and leaves torch as it was.
    """
    try:
        stage = importlib.import_module(_compat.STAGE_MODULE)
        _compat.patch(
            module,
            stage,
            step=_wrap_step,
            batch_p2p=_wrap_batch_p2p,
            wait_batch_p2p=_wrap_wait,
            compute=_wrap_compute,
            sync=_wrap_sync,
        )
    except RuntimeError as exc:  # this torch is not one the backend can hook: said without a traceback
        logger.warning("[attach] cannot patch %s: %s; training continues without FreeRide", module.__name__, exc)
    except Exception:
        logger.exception("[attach] cannot patch %s; training continues without FreeRide", module.__name__)


def attached(schedule: Any) -> TorchPipeAdapter | None:
    """The live adapter watching ``schedule``, if any."""
    return _watched.live(schedule)
