"""The patches that attach FreeRide to megatron-core's pipeline schedules.

:func:`patch_schedules` replaces, in megatron's schedules module, the
``forward_backward_*`` functions (step boundaries, ``p``, ``m``, ``v``, this
rank) and ``forward_step`` / ``backward_step`` (where in the schedule the rank
is, and how long its compute takes); :func:`patch_p2p` wraps the receiving
methods of ``P2PCommunicator`` and the request handles of ``_p2p_ops`` (the
waits, also with ``overlap_p2p_comm``); :func:`wrap_finalize` times the
model config's ``finalize_model_grads_func`` as the step's tail wait. Each
wrapper runs the megatron call unchanged and tells
:func:`~freeride.backends.megatron.adapter.current_adapter` about it. The names come
from :mod:`freeride.backends.megatron._compat`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from freeride.backends.megatron import _compat
from freeride.backends.megatron.adapter import current_adapter
from freeride.backends.schedule import Kind

__all__ = ["patch_p2p", "patch_schedules", "wrap_finalize", "wrap_schedule"]

logger = logging.getLogger(__name__)

_FLAG = "__freeride_megatron__"


def wrap_schedule(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` (a ``forward_backward_*`` function) reporting its steps to the adapter."""
    if getattr(fn, _FLAG, False):
        return fn

    @functools.wraps(fn)
    def freeride_forward_backward(*args: Any, **kwargs: Any) -> Any:
        adapter = current_adapter()
        tracked = adapter.step_begin(name, kwargs)
        try:
            result = fn(*args, **kwargs)
        except BaseException:
            if tracked:
                adapter.step_end(False)
            raise
        if tracked:
            adapter.step_end(True)
        return result

    setattr(freeride_forward_backward, _FLAG, True)
    return freeride_forward_backward


def _wrap_compute(fn: Callable[..., Any], kind: Kind) -> Callable[..., Any]:
    if getattr(fn, _FLAG, False):
        return fn

    @functools.wraps(fn)
    def freeride_compute(*args: Any, **kwargs: Any) -> Any:
        adapter = current_adapter()
        if not adapter.tracking:
            return fn(*args, **kwargs)
        started = adapter.compute_begin(kind)
        result = fn(*args, **kwargs)
        adapter.compute_end(kind, started)
        return result

    setattr(freeride_compute, _FLAG, True)
    return freeride_compute


def _wrap_p2p_method(fn: Callable[..., Any], method: str) -> Callable[..., Any]:
    if getattr(fn, _FLAG, False):
        return fn

    @functools.wraps(fn)
    def freeride_p2p(self: Any, *args: Any, **kwargs: Any) -> Any:
        adapter = current_adapter()
        if not adapter.tracking or not _compat.call_receives(method, args, kwargs):
            return fn(self, *args, **kwargs)
        adapter.wait_begin()
        try:
            return fn(self, *args, **kwargs)
        finally:
            adapter.wait_end()

    setattr(freeride_p2p, _FLAG, True)
    return freeride_p2p


def wrap_finalize(config: Any) -> None:
    """Time ``config.finalize_model_grads_func`` as a wait of the tracked step (idempotent).

    Megatron calls it after a rank's last backward; its gradient all-reduces
    (data-parallel, embedding and pipeline groups) block the rank until the
    ranks it syncs with are done too, so the rank's tail bubble is spent in it.
    The wait is at the plan's tail place; the call's own work (local norms,
    the reduction itself) is timed with it, and learned from as such.
    """
    fn = getattr(config, _compat.FINALIZE_FUNC, None)
    if fn is None or getattr(fn, _FLAG, False):
        return

    @functools.wraps(fn)
    def freeride_finalize(*args: Any, **kwargs: Any) -> Any:
        adapter = current_adapter()
        if not adapter.tracking:
            return fn(*args, **kwargs)
        adapter.wait_begin()
        try:
            return fn(*args, **kwargs)
        finally:
            adapter.wait_end()

    setattr(freeride_finalize, _FLAG, True)
    setattr(config, _compat.FINALIZE_FUNC, freeride_finalize)


class _TimedWork:
    """A receive request whose ``wait()`` is a bubble (``overlap_p2p_comm=True``)."""

    __slots__ = ("_work",)

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        adapter = current_adapter()
        if not adapter.tracking:
            return self._work.wait(*args, **kwargs)
        adapter.wait_begin()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            adapter.wait_end()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _wrap_p2p_ops(fn: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(fn, _FLAG, False):
        return fn

    @functools.wraps(fn)
    def freeride_p2p_ops(*args: Any, **kwargs: Any) -> Any:
        reqs = fn(*args, **kwargs)
        adapter = current_adapter()
        # Inside a receiving P2PCommunicator method the wait is already timed.
        if adapter.tracking and not adapter.in_wait and isinstance(reqs, dict):
            for name in ("recv_prev", "recv_next"):
                if name in reqs:
                    reqs[name] = _TimedWork(reqs[name])
        return reqs

    setattr(freeride_p2p_ops, _FLAG, True)
    return freeride_p2p_ops


def patch_p2p() -> bool:
    """Wrap ``P2PCommunicator``'s receiving methods and ``_p2p_ops`` (idempotent)."""
    cls = _compat.p2p_class()
    module = _compat.p2p_module()
    if cls is None or module is None:
        logger.warning("[attach] %s.P2PCommunicator not found; waits are not tracked", _compat.P2P_MODULE)
        return False
    for method in _compat.RECEIVING_METHODS:
        fn = getattr(cls, method, None)
        if fn is None:
            logger.warning("[attach] P2PCommunicator.%s not found; its waits are not tracked", method)
            continue
        setattr(cls, method, _wrap_p2p_method(fn, method))
    ops = getattr(module, _compat.P2P_OPS, None)
    if ops is None:
        logger.warning("[attach] %s not found: overlap_p2p_comm waits are not tracked", _compat.P2P_OPS)
    else:
        setattr(module, _compat.P2P_OPS, _wrap_p2p_ops(ops))
    return True


def patch_schedules(schedules: ModuleType) -> bool:
    """Patch megatron's schedules module in place (idempotent).

    Returns:
        Whether the module is (now) patched.
    """
    if getattr(schedules, _FLAG, False):
        return True
    missing = [n for n in (*_compat.SCHEDULE_FUNCTIONS, *_compat.STEP_FUNCTIONS) if not hasattr(schedules, n)]
    if missing:
        logger.warning("[attach] %s lacks %s; FreeRide stays off", schedules.__name__, missing)
        return False
    if not patch_p2p():
        return False
    kinds: dict[str, Kind] = {"forward_step": "F", "backward_step": "B"}
    for name, kind in kinds.items():
        setattr(schedules, name, _wrap_compute(getattr(schedules, name), kind))
    for name in _compat.SCHEDULE_FUNCTIONS:
        setattr(schedules, name, wrap_schedule(getattr(schedules, name), name))
    setattr(schedules, _FLAG, True)
    return True
