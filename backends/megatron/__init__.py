"""FreeRide's Megatron-core backend: bubble events from megatron's pipeline schedules.

Two ways to attach, neither needs a change to the training loop:

* ``freeride launch -- torchrun ... train.py``: the import hook calls
  :func:`on_import` right after ``megatron.core.pipeline_parallel.schedules``
  is imported, before the script can call ``get_forward_backward_func()``.
* one line in the script, before ``get_forward_backward_func()``::

      from freeride.backends.megatron import attach
      attach()

  or, for a schedule function obtained earlier,
  ``forward_backward_func = attach(forward_backward_func)``.

Both 1F1B (``forward_backward_pipelining_without_interleaving``) and
interleaved 1F1B (``..._with_interleaving``, also with ``overlap_p2p_comm``,
whose waits happen on request handles) are tracked: every blocking receive is
a bubble, announced before the wait with its expected duration and ended
after it, and each call ends with ``step_finished``. Forward-only calls
(evaluation, inference) are tracked with their own plan: the pipeline fills
once, so a stage waits for its first input and hardly after. Without a
pipeline-wide sync at the end of a step, a rank's tail bubble lands in the
next step's first receive and is announced there; with a
``finalize_model_grads_func`` the tail is spent inside that call (its
gradient all-reduces wait for the other ranks), which is timed and announced
as the step's tail. A rank with pipeline size 1 has no bubbles: it says hello
(``num_stages=1``), logs so once, and its steps run untracked. The fused MoE
schedule (``overlap_moe_expert_parallel_comm``, combined 1F1B) runs untracked:
it needs expert parallelism, bf16 and CUDA streams (see ``_compat``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar, overload

from freeride.backends.megatron import _compat

__all__ = ["attach", "on_import"]

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])


def on_import(module: ModuleType) -> None:
    """Patch megatron-core's freshly imported schedules module (never raises).

    Args:
        module: ``megatron.core.pipeline_parallel.schedules``.
    """
    try:
        from freeride.backends.megatron.patches import patch_schedules

        if patch_schedules(module):
            logger.debug("[attach] megatron schedules patched")
    except Exception:
        logger.exception("[attach] could not patch megatron; training continues without FreeRide")


@overload
def attach() -> None: ...


@overload
def attach(forward_backward_func: _F) -> _F: ...


def attach(forward_backward_func: _F | None = None) -> _F | None:
    """Attach FreeRide to megatron-core's pipeline schedules in this process.

    Args:
        forward_backward_func: A schedule function the script already holds
            (from ``get_forward_backward_func()``); it is returned wrapped.
            Without it, the schedules module is patched, which covers every
            later ``get_forward_backward_func()`` call.

    Returns:
        The wrapped ``forward_backward_func`` (or None without one). On any
        FreeRide problem it is returned unchanged.
    """
    try:
        on_import(importlib.import_module(_compat.SCHEDULES_MODULE))
    except Exception:
        logger.exception("[attach] megatron-core is not importable; FreeRide stays off")
        return forward_backward_func
    if forward_backward_func is None:
        return None
    try:
        from freeride.backends.megatron.patches import wrap_schedule

        name = getattr(forward_backward_func, "__name__", "")
        return wrap_schedule(forward_backward_func, name)  # type: ignore[return-value]
    except Exception:
        logger.exception("[attach] could not wrap %r; it runs without FreeRide", forward_backward_func)
        return forward_backward_func
