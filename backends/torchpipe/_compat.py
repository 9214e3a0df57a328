"""Every use of torch.distributed.pipelining's private names, in one place.

Checked against torch 2.13 (``torch/distributed/pipelining/schedules.py`` and
``stage.py``). What this module relies on:

* ``PipelineScheduleSingle.step`` and ``PipelineScheduleMulti.step`` run one
  training step (every schedule class inherits one of them); ``eval()`` runs the
  same ``step`` with ``_has_backward`` False;
* the module-level functions ``_batch_p2p(ops, desc)`` (posts p2p ops, returns
  their ``Work``\\ s) and ``_wait_batch_p2p(works)`` (blocks on them), which the
  schedules look up as module globals at call time, so replacing them on the
  module takes effect at once;
* ``_PipelineStageBase.forward_one_chunk`` / ``backward_one_chunk`` /
  ``backward_weight_one_chunk``: one F, one B (full or input-gradient: torch's
  ``B`` / ``I``), one W;
* the schedule's own action lists: ``pipeline_order`` (rank -> ``_Action`` or
  None) and, for the runtime schedules, ``pipeline_order_with_comms`` (what
  ``_step_microbatches`` really runs); ``_Action`` has ``stage_index``,
  ``computation_type`` (an enum whose ``value`` is ``F``, ``I``, ``B``, ``W``,
  ``SEND_F``...), ``microbatch_index`` and ``sub_actions`` (``OVERLAP_F_B``);
* ``stage_index_to_group_rank``, ``rank``, ``pp_group_size``, ``_stages`` on
  multi-stage schedules; ``_stage``, ``_num_stages`` on single-stage ones;
  ``_n_microbatches`` on both.

Below the oldest checked release the backend stays out of the way, saying
so: torch 2.10 has these names, but its action lists differ (38 of the
backend's schedule tests fail there), so it would announce compute as bubbles.
On a newer torch it attaches if these names exist (with a warning) and
otherwise stays out of the way, saying which names are missing.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = [
    "CHECKED_VERSIONS",
    "STAGE_MODULE",
    "BatchP2P",
    "ScheduleFacts",
    "StepFn",
    "TorchActions",
    "WaitBatchP2P",
    "has_backward",
    "is_patched",
    "is_recv",
    "missing_names",
    "patch",
    "release",
    "schedule_actions",
    "schedule_facts",
    "torch_version",
    "unpatch",
]

logger = logging.getLogger(__name__)

CHECKED_VERSIONS = ("2.13",)
"""torch releases (major.minor) whose private names were read and tested against."""

STAGE_MODULE = "torch.distributed.pipelining.stage"

StepFn = Callable[..., Any]
"""``schedule.step(*args, **kwargs)`` as an unbound function."""
BatchP2P = Callable[..., list[Any]]
"""``_batch_p2p(p2p_ops, desc=None) -> list[Work]``."""
WaitBatchP2P = Callable[[list[Any]], None]
"""``_wait_batch_p2p(works)``."""
TorchActions = dict[int, list[tuple[int, str, int]]]
"""Per pp rank, its compute actions as (stage index, torch's type letter, micro-batch)."""

_SCHEDULE_NAMES = ("PipelineScheduleSingle", "PipelineScheduleMulti", "_batch_p2p", "_wait_batch_p2p")
_STAGE_CLASS = "_PipelineStageBase"
_COMPUTE_METHODS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}
_SYNC_METHOD = "perform_reduce_grad"
_ORIGINAL = "__freeride_original__"


def torch_version() -> str:
    import torch

    return str(torch.__version__)


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``2.13.0+cpu``; (0, 0) when it has none."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found[1]), int(found[2])) if found else (0, 0)


def missing_names(schedules: ModuleType, stage: ModuleType) -> list[str]:
    """The private names this backend needs that this torch lacks (empty: all there)."""
    missing = [f"schedules.{n}" for n in _SCHEDULE_NAMES if not hasattr(schedules, n)]
    base = getattr(stage, _STAGE_CLASS, None)
    if base is None:
        missing.append(f"stage.{_STAGE_CLASS}")
    else:
        missing += [f"stage.{_STAGE_CLASS}.{m}" for m in _COMPUTE_METHODS if not hasattr(base, m)]
    return missing


def is_patched(schedules: ModuleType) -> bool:
    return hasattr(getattr(schedules, "_wait_batch_p2p", None), _ORIGINAL)


def patch(
    schedules: ModuleType,
    stage: ModuleType,
    *,
    step: Callable[[StepFn], StepFn],
    batch_p2p: Callable[[BatchP2P], BatchP2P],
    wait_batch_p2p: Callable[[WaitBatchP2P], WaitBatchP2P],
    compute: Callable[[str, Callable[..., Any]], Callable[..., Any]],
    sync: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None,
) -> None:
    """Wrap the step methods, the two p2p helpers and the stage's compute methods.

    Args:
        schedules: ``torch.distributed.pipelining.schedules``.
        stage: ``torch.distributed.pipelining.stage``.
        step: Builds a replacement ``step`` from the original one.
        batch_p2p: Likewise for ``_batch_p2p``.
        wait_batch_p2p: Likewise for ``_wait_batch_p2p``.
        compute: ``compute(kind, original)`` builds a replacement compute method
            (``kind``: ``F``, ``B`` or ``W``).
        sync: Builds a replacement ``perform_reduce_grad`` (skipped where torch has none).

    Raises:
        RuntimeError: This torch is older than every checked release, or lacks a
            name the backend needs (the message says which).
    """
    version = torch_version()
    oldest = min(CHECKED_VERSIONS, key=release)
    if release(version) < release(oldest):
        raise RuntimeError(
            f"torch {version} is older than {oldest}, the oldest release FreeRide's "
            "torch.distributed.pipelining backend was checked against (its schedules' action lists differ); "
            "training runs without FreeRide"
        )
    missing = missing_names(schedules, stage)
    if missing:
        raise RuntimeError(
            f"torch {torch_version()} lacks {missing}: FreeRide's torch.distributed.pipelining backend "
            f"was written for torch {', '.join(CHECKED_VERSIONS)}; training runs without FreeRide"
        )
    if is_patched(schedules):
        return
    if release(version) not in map(release, CHECKED_VERSIONS):
        logger.warning("[attach] torch %s was not checked (checked: %s); attaching anyway", version, CHECKED_VERSIONS)
    for cls_name in ("PipelineScheduleSingle", "PipelineScheduleMulti"):
        cls = getattr(schedules, cls_name)
        _replace(cls, "step", step(cls.step))
    _replace(schedules, "_batch_p2p", batch_p2p(schedules._batch_p2p))
    _replace(schedules, "_wait_batch_p2p", wait_batch_p2p(schedules._wait_batch_p2p))
    base = getattr(stage, _STAGE_CLASS)
    for method, kind in _COMPUTE_METHODS.items():
        _replace(base, method, compute(kind, getattr(base, method)))
    if sync is not None and hasattr(base, _SYNC_METHOD):
        _replace(base, _SYNC_METHOD, sync(getattr(base, _SYNC_METHOD)))


def _replace(owner: Any, name: str, new: Callable[..., Any]) -> None:
    setattr(new, _ORIGINAL, getattr(owner, name))
    setattr(owner, name, new)


def unpatch(schedules: ModuleType, stage: ModuleType) -> None:
    """Put the originals back (tests)."""
    owners: list[tuple[Any, Sequence[str]]] = [
        (getattr(schedules, "PipelineScheduleSingle", None), ("step",)),
        (getattr(schedules, "PipelineScheduleMulti", None), ("step",)),
        (schedules, ("_batch_p2p", "_wait_batch_p2p")),
        (getattr(stage, _STAGE_CLASS, None), (*_COMPUTE_METHODS, _SYNC_METHOD)),
    ]
    for owner, names in owners:
        for name in names:
            current = getattr(owner, name, None) if owner is not None else None
            original = getattr(current, _ORIGINAL, None)
            if original is not None:
                setattr(owner, name, original)


def is_recv(p2p_op: Any) -> bool:
    """Whether a ``dist.P2POp`` receives."""
    return getattr(getattr(p2p_op, "op", None), "__name__", "") == "irecv"


def has_backward(schedule: Any) -> bool:
    """Whether this ``step`` trains (``eval()`` clears the flag for its call)."""
    return bool(getattr(schedule, "_has_backward", False))


@dataclass(frozen=True, slots=True)
class ScheduleFacts:
    """Who a rank is in the pipeline its schedule runs."""

    name: str
    """The schedule class, e.g. ``Schedule1F1B``."""
    rank: int
    """Rank in the pipeline group (FreeRide's stage)."""
    num_ranks: int
    num_microbatches: int
    stage_indices: tuple[int, ...]
    """torch's stage indices this rank runs."""
    num_stages: int
    """torch's stages in all (ranks x stages per rank)."""
    stage_to_rank: dict[int, int]
    device_type: str
    device_index: int


def schedule_facts(schedule: Any) -> ScheduleFacts:
    stages: list[Any] = list(getattr(schedule, "_stages", None) or [schedule._stage])
    first = stages[0]
    num_stages = int(first.num_stages)
    if hasattr(schedule, "stage_index_to_group_rank"):
        rank, num_ranks = int(schedule.rank), int(schedule.pp_group_size)
        mapping = {int(k): int(v) for k, v in schedule.stage_index_to_group_rank.items()}
    else:
        rank, num_ranks = int(first.stage_index), num_stages
        mapping = {s: s for s in range(num_stages)}
    device = getattr(first, "device", None)
    device_type = str(getattr(device, "type", "cpu"))
    index = getattr(device, "index", None)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return ScheduleFacts(
        name=type(schedule).__name__,
        rank=rank,
        num_ranks=num_ranks,
        num_microbatches=int(schedule._n_microbatches),
        stage_indices=tuple(int(s.stage_index) for s in stages),
        num_stages=num_stages,
        stage_to_rank=mapping,
        device_type=device_type,
        device_index=local_rank if index is None else int(index),
    )


def _flatten(action: Any) -> list[Any]:
    subs = getattr(action, "sub_actions", None)
    if subs:
        return [a for sub in subs for a in _flatten(sub)]
    return [action]


def schedule_actions(schedule: Any) -> TorchActions | None:
    """Every rank's compute actions in the order the schedule runs them (None: it lists none).

    Runtime schedules run ``pipeline_order_with_comms``; the others follow
    ``pipeline_order`` (both are the schedule's own data, rebuilt per
    ``n_microbatches``). ``OVERLAP_F_B`` is flattened into its sub-actions.
    """
    order = getattr(schedule, "pipeline_order_with_comms", None) or getattr(schedule, "pipeline_order", None)
    if not order:
        return None
    rows: TorchActions = {}
    for rank, row in order.items():
        out: list[tuple[int, str, int]] = []
        for action in row:
            if action is None:
                continue
            for a in _flatten(action):
                mb = -1 if a.microbatch_index is None else int(a.microbatch_index)
                out.append((int(a.stage_index), str(a.computation_type.value), mb))
        rows[int(rank)] = out
    return rows
