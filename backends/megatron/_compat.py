"""Every use of megatron-core internals by FreeRide, in one place.

Checked against megatron-core 0.16.1 (``megatron/core/pipeline_parallel/``).
What is relied on, and why it is not public API:

* ``schedules.forward_backward_pipelining_without_interleaving`` /
  ``..._with_interleaving`` / ``forward_backward_no_pipelining``: module
  globals that ``get_forward_backward_func()`` reads at call time, so replacing
  them before the user calls it routes every step through our wrapper.
* ``schedules.forward_step`` / ``schedules.backward_step``: called by global
  name from the schedules, once per micro-batch (per model chunk), so they tell
  where in the schedule a rank is.
* ``P2PCommunicator`` methods (``p2p_communication``): every blocking wait for
  a neighbour's activations or gradients happens inside one of them, except
  with ``overlap_p2p_comm=True``, where the schedule waits on request handles
  returned by the module-private ``_p2p_ops``.
* ``get_pp_rank_microbatches`` / ``get_schedule_table`` (schedules): the
  warm-up counts and the interleaved order, taken from megatron itself.
* ``megatron.core.utils.get_model_config``: the model's config (``overlap_p2p_comm``,
  ``microbatch_group_size_per_vp_stage``, ``finalize_model_grads_func``).
* ``config.finalize_model_grads_func``: the schedules read it from the config
  at the end of every training call, so the adapter replaces it there with a
  wrapper that times it (the user's function still runs, unchanged).
* ``overlap_moe_expert_parallel_comm`` (the combined 1F1B schedule of
  ``combined_1f1b.py``): not tracked. It needs expert parallelism > 1 with an
  all-to-all dispatcher, bf16/fp16, a ``GPTModel`` that builds schedule plans
  and two CUDA streams (``set_streams``), so no CPU job can run it.
  0.16.1 has no zero-bubble schedule (``delay_wgrad_compute`` splits the MoE
  weight gradients only inside combined 1F1B).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = [
    "CHUNK_SCHEDULE",
    "FINALIZE_FUNC",
    "INTERLEAVED_SCHEDULE",
    "NO_PIPELINING",
    "P2P_MODULE",
    "P2P_OPS",
    "PLAIN_SCHEDULE",
    "RECEIVING_METHODS",
    "SCHEDULE_FUNCTIONS",
    "SCHEDULES_MODULE",
    "STEP_FUNCTIONS",
    "TESTED_VERSIONS",
    "CallInfo",
    "call_info",
    "call_receives",
    "megatron_version",
    "p2p_class",
    "p2p_module",
    "schedule_table",
]

logger = logging.getLogger(__name__)

TESTED_VERSIONS = ("0.16.1",)
"""megatron-core versions whose internals this module was checked against."""

SCHEDULES_MODULE = "megatron.core.pipeline_parallel.schedules"
P2P_MODULE = "megatron.core.pipeline_parallel.p2p_communication"

NO_PIPELINING = "forward_backward_no_pipelining"
PLAIN_SCHEDULE = "forward_backward_pipelining_without_interleaving"
INTERLEAVED_SCHEDULE = "forward_backward_pipelining_with_interleaving"
SCHEDULE_FUNCTIONS = (NO_PIPELINING, PLAIN_SCHEDULE, INTERLEAVED_SCHEDULE)
"""The ``forward_backward_*`` globals of the schedules module."""
CHUNK_SCHEDULE = {PLAIN_SCHEDULE: "1f1b", INTERLEAVED_SCHEDULE: "interleaved"}
"""Which FreeRide schedule each pipelined megatron function runs."""

FINALIZE_FUNC = "finalize_model_grads_func"
"""Config attribute megatron calls after the last backward of a training call."""

STEP_FUNCTIONS = ("forward_step", "backward_step")
"""Per-micro-batch compute globals of the schedules module."""

P2P_OPS = "_p2p_ops"
"""Unbatched p2p launcher of ``p2p_communication``; returns ``{name: Work}``."""


def _recv_prev(args: tuple[Any, ...], kwargs: Mapping[str, Any], pos: int) -> bool:
    return bool(kwargs["recv_prev"] if "recv_prev" in kwargs else args[pos] if len(args) > pos else False)


def _recv_next(args: tuple[Any, ...], kwargs: Mapping[str, Any], pos: int) -> bool:
    return bool(kwargs["recv_next"] if "recv_next" in kwargs else args[pos] if len(args) > pos else False)


def _not_flag(args: tuple[Any, ...], kwargs: Mapping[str, Any], name: str, pos: int) -> bool:
    """True unless the ``is_first_stage``/``is_last_stage`` flag (which turns the call into a no-op) is set."""
    flag = kwargs[name] if name in kwargs else args[pos] if len(args) > pos else False
    return not flag


# Positions count the arguments after ``self``.
RECEIVING_METHODS: dict[str, Callable[[tuple[Any, ...], Mapping[str, Any]], bool]] = {
    "recv_forward": lambda a, k: _not_flag(a, k, "is_first_stage", 1),
    "recv_backward": lambda a, k: _not_flag(a, k, "is_last_stage", 1),
    "send_forward_recv_backward": lambda a, k: _not_flag(a, k, "is_last_stage", 2),
    "send_backward_recv_forward": lambda a, k: _not_flag(a, k, "is_first_stage", 2),
    "send_forward_recv_forward": lambda a, k: _recv_prev(a, k, 1),
    "send_backward_recv_backward": lambda a, k: _recv_next(a, k, 1),
    "send_forward_backward_recv_forward_backward": lambda a, k: _recv_prev(a, k, 2) or _recv_next(a, k, 3),
}
"""``P2PCommunicator`` methods that may block on a receive, and whether a call does."""


def call_receives(method: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether ``P2PCommunicator.<method>(*args, **kwargs)`` waits for a neighbour now.

    Calls made with ``overlap_p2p_comm=True`` only launch requests; the wait
    happens later on the returned handles.
    """
    if kwargs.get("overlap_p2p_comm", False):
        return False
    check = RECEIVING_METHODS.get(method)
    if check is None:
        return False
    try:
        return check(args, kwargs)
    except (KeyError, IndexError, TypeError):
        return True  # unknown signature: a receiving method, so assume it waits


def megatron_version() -> str:
    """The installed megatron-core version, or ``"unknown"``."""
    try:
        from megatron.core import package_info

        return str(package_info.__version__)
    except Exception:
        return "unknown"


def p2p_module() -> ModuleType | None:
    """The imported ``p2p_communication`` module (schedules.py imports it first)."""
    return sys.modules.get(P2P_MODULE)


def p2p_class() -> type[Any] | None:
    module = p2p_module()
    cls = getattr(module, "P2PCommunicator", None) if module is not None else None
    return cls if isinstance(cls, type) else None


@dataclass(frozen=True, kw_only=True, slots=True)
class CallInfo:
    """What one ``forward_backward_*`` call will run on this rank."""

    num_stages: int
    """Pipeline-parallel size ``p``."""
    stage: int
    """Pipeline rank of this process."""
    num_microbatches: int
    num_chunks: int
    """Model chunks on this rank (``v``; 1 unless interleaved)."""
    group_size: int
    """``microbatch_group_size_per_vp_stage`` (interleaved only; ``p`` otherwise)."""
    forward_only: bool
    overlap_p2p_comm: bool
    combined_1f1b: bool
    """``overlap_moe_expert_parallel_comm``: megatron runs a different, fused schedule."""
    has_finalize: bool
    """A ``finalize_model_grads_func`` ends the step (a pipeline-wide sync point)."""
    config: Any
    """The model's ``TransformerConfig``."""


def call_info(kwargs: Mapping[str, Any]) -> CallInfo:
    """Read ``p``, the rank, ``m``, ``v`` and the relevant config of a schedule call.

    Raises:
        Exception: Whatever megatron raises when the call is not a valid
            pipelined call; callers fall back to running it untracked.
    """
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    model = kwargs["model"]
    chunks = list(model) if isinstance(model, list) else [model]
    config = get_model_config(chunks[0])
    comm = kwargs.get("p2p_communicator")
    if comm is not None:
        p, stage = comm.pp_group.size(), comm.pp_group.rank()
    else:
        p = parallel_state.get_pipeline_model_parallel_world_size()
        stage = parallel_state.get_pipeline_model_parallel_rank()
    group = getattr(config, "microbatch_group_size_per_vp_stage", None) or p
    return CallInfo(
        num_stages=int(p),
        stage=int(stage),
        num_microbatches=int(kwargs["num_microbatches"]),
        num_chunks=len(chunks),
        group_size=int(group),
        forward_only=bool(kwargs.get("forward_only", False)),
        overlap_p2p_comm=bool(getattr(config, "overlap_p2p_comm", False)),
        combined_1f1b=bool(getattr(config, "overlap_moe_expert_parallel_comm", False)),
        has_finalize=getattr(config, "finalize_model_grads_func", None) is not None,
        config=config,
    )


def schedule_table(num_microbatches: int, num_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """Megatron's interleaved forward order as ``(microbatch, chunk)`` pairs."""
    schedules = sys.modules.get(SCHEDULES_MODULE)
    fn = getattr(schedules, "get_schedule_table", None)
    if fn is None:
        raise RuntimeError(f"{SCHEDULES_MODULE}.get_schedule_table is missing")
    return [(int(mb), int(c)) for mb, c in fn(num_microbatches, num_chunks, group_size)]
