"""Side tasks as both the control and the worker sockets carry them: the spec, its kinds, a task's states."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import msgspec

from freeride.protocol.base import Bytes, DeviceKind, Message, Name, NanosOrUnknown, Options, Small, Text

__all__ = ["TERMINAL_STATES", "IterativeSpec", "ProgramSpec", "SidePriority", "TaskKind", "TaskSpec", "TaskState"]


TaskKind = Literal["iterative", "imperative"]
SidePriority = Literal["low", "same"]
"""CPU priority of side tasks on a CPU device. ``low``: nice 19, so the stage preempts a side step
that runs past a bubble's end (the production default on CPU). ``same``: the stage's own priority,
so such a step delays the stage as it would on a GPU, which does not preempt a running kernel
(the GPU-faithful stand-in that benchmarks use)."""

TaskState = Literal["pending", "starting", "running", "finished", "failed", "cancelled"]

TERMINAL_STATES: frozenset[TaskState] = frozenset({"finished", "failed", "cancelled"})
"""States a task never leaves."""


class _Spec(Message, frozen=True, kw_only=True):
    """What every side task needs, whatever its kind."""

    name: Name = ""
    peak_memory: Bytes = -1
    """Peak device memory in bytes (declared or profiled), -1 if unknown."""
    device: Name = ""
    """Pin to this device; empty lets the manager place the task."""
    max_restarts: Small = 3
    """How often a crashed task is restarted (an iterative one from its last checkpoint)."""
    sm_share: Annotated[int, msgspec.Meta(ge=-1, le=100)] = -1
    """Percent of the GPU's SMs the task's process may occupy (MPS active thread
    percentage; 0 and -1: the manager's default, which leaves SMs for the trainer's NCCL kernels)."""
    device_kind: DeviceKind = "any"
    """The device the task needs (an iterative task's class's ``device_kind``): a ``gpu`` task waits for a
    CUDA device."""


class IterativeSpec(_Spec, frozen=True, kw_only=True, tag="iterative_spec"):
    """An iterative task: a class against FreeRide's API, run step by step in a worker."""

    kind: ClassVar[TaskKind] = "iterative"
    target: Text
    """``module:Class`` of the task."""
    options: Options = {}
    """Keyword arguments of the class."""
    step_time_ns: NanosOrUnknown = -1
    """Profiled step time, -1 if unknown."""
    fill: bool = False
    """A filler: it takes a bubble only once the device's other tasks have given it back, so that a task
    of short steps fills the ends of bubbles that a task of long steps leaves (a mix per device)."""
    checkpoint_dir: Text = ""
    """The task's checkpoint directory (absolute, existing); empty: the manager's own state dir. A
    directory on storage every node mounts lets a task resume on another node (the cluster queue's jobs)."""


class ProgramSpec(_Spec, frozen=True, kw_only=True, tag="program_spec"):
    """An imperative task: an unmodified program, resumed and frozen by signals."""

    kind: ClassVar[TaskKind] = "imperative"
    argv: Annotated[list[Text], msgspec.Meta(min_length=1, max_length=4096)]
    """The command line."""
    cwd: Text = ""
    """The working directory (absolute); empty: the task's own workdir under the state dir."""
    env: Annotated[dict[Name, Text], msgspec.Meta(max_length=4096)] = {}
    """Variables laid over the manager's small base environment (see :mod:`freeride.tasks.programs`);
    never shown in status."""
    sync_every: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    """A PyTorch program synchronizes CUDA every this many optimizer steps (0: never)."""
    progress_file: Text = ""
    """A file the program writes its step (a number) or metrics (a JSON object) to."""
    progress_pattern: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    """A regular expression with named groups matched against each line of the program's stdout."""


TaskSpec = IterativeSpec | ProgramSpec
"""What a user submits: a side task of either kind and what it needs."""
