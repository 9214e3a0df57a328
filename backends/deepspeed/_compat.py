"""Every use of DeepSpeed's private names, in one place.

Checked against DeepSpeed 0.19.8 (``deepspeed/runtime/pipe/engine.py``,
``dualpipev.py``, ``schedule.py``, ``deepspeed/comm``). What this module relies on:

* ``PipelineEngine._exec_schedule(self, pipe_schedule)`` runs one batch's
  schedule and is inherited by ``DualPipeVEngine``;
* ``PipelineEngine._INSTRUCTION_MAP`` maps instruction classes to the functions
  captured at class definition; ``_exec_schedule`` reads it through ``self``, so a
  per-instance dict shadows it (patching ``_exec_recv_activations`` does nothing);
* ``PipelineEngine._aggregate_total_loss(self)`` is the loss broadcast over the
  pipe group that ``train_batch`` runs after the schedule;
* ``TrainSchedule`` runs each stage's forward and backward passes in the order of
  :func:`freeride.backends.schedule.one_f_one_b` (checked by the unit tests);
* ``OptimizerStep`` clips gradients through ``deepspeed.comm.all_reduce`` over the
  model-parallel group (``gradient_clipping > 0``): the end-of-step sync;
* ``TrainSchedule._step_to_micro_batch`` (tests only: it cross-checks our own
  micro-batch numbering);
* ``DualPipeVSchedule(micro_batches, stages, stage_id)`` lists, through its public
  ``steps()``, every rank's instructions; ``ForwardPass`` / ``BackwardPass`` and the
  p2p instructions carry ``buffer_id = phase * micro_batches + micro_batch`` and
  ``phase``; only ``CommitP2P`` blocks (``batch_isend_irecv`` then ``wait``);
* ``ReduceGrads`` / ``ReduceTiedGrads`` all-reduce through ``deepspeed.comm.all_reduce``
  over the data-parallel group and the tied-weight groups: waits where those ranks lag.

On another DeepSpeed version the adapter still attaches if these names exist
(with a warning) and stays out of the way if they do not.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

__all__ = [
    "BACKWARD",
    "CHECKED_VERSIONS",
    "COMMIT_P2P",
    "FORWARD",
    "OPTIMIZER_STEP",
    "REDUCE_INSTRUCTIONS",
    "SEND_INSTRUCTIONS",
    "WAIT_INSTRUCTIONS",
    "EngineFacts",
    "ExecSchedule",
    "Instruction",
    "ScheduleFacts",
    "class_instruction_map",
    "deepspeed_version",
    "engine_facts",
    "global_steps",
    "instruction_rows",
    "is_patched",
    "patch_pipeline_engine",
    "schedule_facts",
    "shadow_instruction_map",
    "step_to_micro_batch",
    "timed_collectives",
    "unpatch_pipeline_engine",
    "unshadow_instruction_map",
]

logger = logging.getLogger(__name__)

CHECKED_VERSIONS = frozenset({"0.19.8"})
"""DeepSpeed versions whose private names were read and tested against."""

FORWARD = "ForwardPass"
BACKWARD = "BackwardPass"
OPTIMIZER_STEP = "OptimizerStep"
WAIT_INSTRUCTIONS = frozenset({"RecvActivation", "RecvGrad", "CommitP2P", "SendActivation", "SendGrad"})
"""Instructions in which a stage can block on its neighbours (``CommitP2P``: DualPipeV).
Sends block too where the transport hands large tensors over only once the peer
has posted its receive (gloo), and are then as idle as a receive."""
SEND_INSTRUCTIONS = frozenset({"SendActivation", "SendGrad"})
COMMIT_P2P = "CommitP2P"
"""DualPipeV's only blocking p2p instruction: it launches the queued sends and receives and waits."""
REDUCE_INSTRUCTIONS: dict[str, str] = {"ReduceGrads": "dp", "ReduceTiedGrads": "tied"}
"""Instructions that all-reduce gradients across ranks, and the prefix of their waits' keys."""

Instruction = tuple[str, dict[str, int]]
"""One pipeline instruction as (class name, integer keyword arguments)."""

ExecSchedule = Callable[[Any, Any], Any]
"""``PipelineEngine._exec_schedule(engine, pipe_schedule)``."""
AggregateLoss = Callable[[Any], Any]
"""``PipelineEngine._aggregate_total_loss(engine)``."""

_REQUIRED = ("_exec_schedule", "_aggregate_total_loss", "_INSTRUCTION_MAP")
_ORIGINAL = "__freeride_original__"
_SHADOW = "_INSTRUCTION_MAP"


def deepspeed_version() -> str:
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _pipeline_engine(module: ModuleType) -> type[Any] | None:
    cls = getattr(module, "PipelineEngine", None)
    if not isinstance(cls, type):
        logger.warning("[attach] %s has no PipelineEngine class", module.__name__)
        return None
    missing = [name for name in _REQUIRED if not hasattr(cls, name)]
    if missing:
        logger.warning(
            "[attach] DeepSpeed %s: PipelineEngine lacks %s; FreeRide stays detached",
            deepspeed_version(),
            missing,
        )
        return None
    return cls


def is_patched(module: ModuleType) -> bool:
    cls = getattr(module, "PipelineEngine", None)
    return cls is not None and hasattr(cls.__dict__.get("_exec_schedule"), _ORIGINAL)


def patch_pipeline_engine(
    module: ModuleType,
    *,
    exec_schedule: Callable[[ExecSchedule], ExecSchedule],
    aggregate_loss: Callable[[AggregateLoss], AggregateLoss],
) -> bool:
    """Wrap ``PipelineEngine._exec_schedule`` and ``_aggregate_total_loss`` at class level.

    Args:
        module: ``deepspeed.runtime.pipe.engine``.
        exec_schedule: Builds the replacement from the original method.
        aggregate_loss: Likewise for ``_aggregate_total_loss``.

    Returns:
        Whether the class is patched (now or already).
    """
    cls = _pipeline_engine(module)
    if cls is None:
        return False
    if is_patched(module):
        return True
    version = deepspeed_version()
    if version not in CHECKED_VERSIONS:
        logger.warning(
            "[attach] DeepSpeed %s was not checked (checked: %s); attaching anyway",
            version,
            sorted(CHECKED_VERSIONS),
        )
    original_exec = cls._exec_schedule
    original_loss = cls._aggregate_total_loss
    new_exec = exec_schedule(original_exec)
    new_loss = aggregate_loss(original_loss)
    setattr(new_exec, _ORIGINAL, original_exec)
    setattr(new_loss, _ORIGINAL, original_loss)
    cls._exec_schedule = new_exec
    cls._aggregate_total_loss = new_loss
    return True


def unpatch_pipeline_engine(module: ModuleType) -> None:
    """Put the original methods back (tests and explicit detaching)."""
    cls = getattr(module, "PipelineEngine", None)
    if cls is None:
        return
    for name in ("_exec_schedule", "_aggregate_total_loss"):
        original = getattr(cls.__dict__.get(name), _ORIGINAL, None)
        if original is not None:
            setattr(cls, name, original)


def class_instruction_map(engine: Any) -> dict[type[Any], Callable[..., Any]]:
    """The engine class's instruction table (not a per-instance shadow)."""
    return dict(type(engine)._INSTRUCTION_MAP)


def shadow_instruction_map(engine: Any, table: dict[type[Any], Callable[..., Any]]) -> None:
    """Make ``engine`` (only) dispatch its instructions through ``table``."""
    engine.__dict__[_SHADOW] = table


def unshadow_instruction_map(engine: Any) -> None:
    engine.__dict__.pop(_SHADOW, None)


@dataclass(frozen=True, slots=True)
class ScheduleFacts:
    """What a schedule object says about the batch it runs."""

    kind: Literal["train", "dualpipev", "other"]
    """``train``: ``TrainSchedule`` (1F1B); ``dualpipev``: training with DualPipeV."""
    name: str
    stages: int
    stage_id: int
    micro_batches: int

    @property
    def training(self) -> bool:
        return self.kind != "other"


def schedule_facts(pipe_schedule: Any) -> ScheduleFacts:
    name = type(pipe_schedule).__name__
    kind: Literal["train", "dualpipev", "other"] = "other"
    if name == "TrainSchedule":
        kind = "train"
    elif name == "DualPipeVSchedule" and not getattr(pipe_schedule, "forward_only", False):
        kind = "dualpipev"
    return ScheduleFacts(
        kind=kind,
        name=name,
        stages=int(pipe_schedule.stages),
        stage_id=int(pipe_schedule.stage_id),
        micro_batches=int(pipe_schedule.micro_batches),
    )


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """Who a pipeline engine is."""

    rank: int
    stage: int
    num_stages: int
    micro_batches: int
    gradient_clipping: float
    device_type: str
    device_index: int
    local_rank: int


def engine_facts(engine: Any) -> EngineFacts:
    device = getattr(engine, "device", None)
    local_rank = int(getattr(engine, "local_rank", os.environ.get("LOCAL_RANK", "0")))
    device_type = str(getattr(device, "type", "cpu"))
    index = getattr(device, "index", None)
    return EngineFacts(
        rank=int(engine.global_rank),
        stage=int(engine.stage_id),
        num_stages=int(engine.num_stages),
        micro_batches=int(engine.micro_batches),
        gradient_clipping=float(engine.gradient_clipping() or 0.0),
        device_type=device_type,
        device_index=local_rank if index is None else int(index),
        local_rank=local_rank,
    )


def global_steps(engine: Any) -> int:
    """Optimizer steps taken so far (the step the next batch becomes)."""
    return int(engine.global_steps)


@contextmanager
def timed_collectives(wait: Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]) -> Iterator[None]:
    """Route ``deepspeed.comm.all_reduce`` calls of this thread through ``wait`` meanwhile.

    ``wait(fn, args, kwargs)`` must call ``fn(*args, **kwargs)`` and return its result.
    Other threads' calls go straight through. Used around ``OptimizerStep``, whose
    gradient-norm all-reduce is where stages wait for the slowest one.
    """
    comm: Any = sys.modules.get("deepspeed.comm")
    original = getattr(comm, "all_reduce", None)
    if comm is None or original is None:
        yield
        return
    owner = threading.get_ident()

    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != owner:
            return original(*args, **kwargs)
        return wait(original, args, kwargs)

    comm.all_reduce = all_reduce
    try:
        yield
    finally:
        if comm.all_reduce is all_reduce:
            comm.all_reduce = original


def instruction_rows(pipe_schedule: Any) -> tuple[tuple[Instruction, ...], ...]:
    """Every pipeline rank's instructions for one batch of ``pipe_schedule``'s kind.

    Builds the schedule of each rank with the same class and sizes (a ``PipeSchedule``
    is a pure generator of instructions) and flattens its ``steps()``.
    """
    cls = type(pipe_schedule)
    m, p = int(pipe_schedule.micro_batches), int(pipe_schedule.stages)
    rows = []
    for stage in range(p):
        sched = cls(micro_batches=m, stages=p, stage_id=stage)
        cmds = [cmd for step in sched.steps() for cmd in step]
        rows.append(tuple((type(cmd).__name__, {k: int(v) for k, v in cmd.kwargs.items()}) for cmd in cmds))
    return tuple(rows)


def step_to_micro_batch(pipe_schedule: Any, step_id: int) -> tuple[int, bool]:
    """DeepSpeed's own (micro-batch, is_forward) for schedule step ``step_id`` of a TrainSchedule."""
    micro_batch, is_forward = pipe_schedule._step_to_micro_batch(step_id)
    return int(micro_batch), bool(is_forward)
