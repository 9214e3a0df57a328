"""Run megatron-core's pipeline schedules on CPU (gloo), for tests and CPU demos.

megatron-core 0.16.1 hard-codes CUDA on the schedule path: ``device="cuda"``
in ``torch.zeros`` calls of the schedules, receive buffers allocated on
``torch.cuda.current_device()`` and ``torch.cuda.synchronize()`` after batched
p2p. :func:`activate` rewrites those at run time, without editing megatron:

* a :class:`CudaToCpuMode` (a ``TorchFunctionMode``) is entered around the
  ``forward_backward_*`` schedule functions and turns ``device="cuda"`` (or a
  device index) into ``"cpu"`` in factory calls;
* ``torch.cuda.current_device`` returns ``"cpu"`` (a mode cannot catch it: it
  runs before the factory call);
* ``torch.cuda.synchronize`` does nothing.

It refuses to run where CUDA is available, so it can never reroute a real GPU
job, and FreeRide's import hook never activates it: only CPU training scripts
and tests call :func:`activate`.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from freeride.backends.megatron import _compat

__all__ = ["CudaToCpuMode", "ShimRefused", "activate", "active", "cpu_shim", "deactivate"]

logger = logging.getLogger(__name__)

_SHIM_FLAG = "__freeride_cpu_shim__"


class ShimRefused(RuntimeError):
    """The CPU shim was asked to activate on a machine with a usable GPU."""


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device="cuda"`` / ``device=<int>`` to ``"cpu"`` in torch calls made under it."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and _is_cuda(device):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


def _is_cuda(device: object) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str | torch.device):
        try:
            return torch.device(device).type == "cuda"
        except RuntimeError:
            return False
    return False


_saved_torch: dict[str, Callable[..., Any]] = {}
_saved_schedules: dict[str, Callable[..., Any]] = {}


def _in_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run_on_cpu(*args: Any, **kwargs: Any) -> Any:
        with CudaToCpuMode():
            return fn(*args, **kwargs)

    setattr(run_on_cpu, _SHIM_FLAG, True)
    return run_on_cpu


def _cpu_current_device() -> str:
    return "cpu"


def _no_synchronize(device: object = None) -> None:
    return None


def active() -> bool:
    """Whether :func:`activate` is in effect."""
    return bool(_saved_torch)


def activate() -> None:
    """Make megatron-core's schedules run on CPU (idempotent).

    Call it before ``get_forward_backward_func()``: that function reads the
    schedule functions when called, and scripts usually keep its result.

    Raises:
        ShimRefused: CUDA is available; the shim is for machines without a GPU.
    """
    if torch.cuda.is_available():
        raise ShimRefused(
            "the megatron CPU shim reroutes CUDA calls to the CPU and is meant for machines "
            "without a GPU; torch.cuda.is_available() is True here, so it refuses to activate"
        )
    if active():
        return
    schedules = importlib.import_module(_compat.SCHEDULES_MODULE)
    _saved_torch["current_device"] = torch.cuda.current_device
    _saved_torch["synchronize"] = torch.cuda.synchronize
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
    torch.cuda.synchronize = _no_synchronize
    for name in _compat.SCHEDULE_FUNCTIONS:
        fn = getattr(schedules, name)
        _saved_schedules[name] = fn
        setattr(schedules, name, _in_mode(fn))
    logger.info("[shim] megatron schedules rerouted from CUDA to CPU")


def deactivate() -> None:
    """Undo :func:`activate` (idempotent)."""
    if not active():
        return
    schedules = importlib.import_module(_compat.SCHEDULES_MODULE)
    for name, fn in _saved_schedules.items():
        setattr(schedules, name, fn)
    torch.cuda.current_device = _saved_torch["current_device"]
    torch.cuda.synchronize = _saved_torch["synchronize"]
    _saved_schedules.clear()
    _saved_torch.clear()


@contextmanager
def cpu_shim() -> Iterator[None]:
    """:func:`activate` for the duration of a ``with`` block."""
    activate()
    try:
        yield
    finally:
        deactivate()
