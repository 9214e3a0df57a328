"""The wire contract: every message that crosses a FreeRide process boundary.

Three sockets carry three unions, each decoded by one typed decoder:

* backend -> manager (:data:`BackendEvent`): a training rank reports its
  bubbles. Fire-and-forget; the training process never waits.
* manager <-> side-task worker (:data:`ManagerToWorker`, :data:`WorkerToManager`):
  the manager grants bubble time, the worker reports what it did with it.
* control client <-> manager (:data:`ControlRequest`, :data:`ControlReply`):
  submit, cancel and inspect side tasks.

Every Struct is frozen and tagged. Events are past tense, commands imperative.
Timestamps are ``time.monotonic_ns()`` integers: CLOCK_MONOTONIC is shared by
all processes of one host, and FreeRide only crosses process boundaries inside
one node. Evolve append-only: new fields get defaults, and
:data:`PROTOCOL_VERSION` changes only when an old peer could misread a frame.
"""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = [
    "PROTOCOL_VERSION",
    "Assign",
    "BackendEvent",
    "BubbleEnded",
    "BubbleStarted",
    "Cancel",
    "Cancelled",
    "Checkpointed",
    "ControlReply",
    "ControlRequest",
    "DeviceStatus",
    "Goodbye",
    "Grant",
    "GrantDone",
    "GrantDoneReason",
    "Heartbeat",
    "Hello",
    "LatencySummary",
    "ManagerToWorker",
    "Metrics",
    "Options",
    "Progress",
    "Rejected",
    "Revoke",
    "StatusReply",
    "StatusRequest",
    "StepFinished",
    "Stop",
    "Submit",
    "Submitted",
    "TaskFailed",
    "TaskFinished",
    "TaskKind",
    "TaskSpec",
    "TERMINAL_STATES",
    "SidePriority",
    "TaskState",
    "TaskStatus",
    "WorkerReady",
    "WorkerToManager",
]

PROTOCOL_VERSION = 1
"""Bumped only when a peer of another version could misread a frame."""

Metrics = dict[str, float]
"""Named numbers a side task reports (loss, accuracy, images, ...)."""

Options = dict[str, str | int | float | bool]
"""Constructor arguments of a side task: plain scalars only."""


class _Msg(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every message: frozen, keyword-only, tagged by subclasses."""


# --------------------------------------------------------------------------
# backend -> manager
# --------------------------------------------------------------------------


class Hello(_Msg, frozen=True, tag="hello"):
    """First message of a training rank; announces who it is."""

    protocol_version: int
    rank: int
    stage: int
    num_stages: int
    device: str
    """Device the stage computes on, e.g. ``cuda:0`` or ``cpu:1``."""
    framework: str
    """``deepspeed``, ``megatron`` or ``sim``."""
    pid: int
    cpu_affinity: list[int] = []
    """Cores the rank may run on; side tasks of this device are pinned to them."""
    device_memory: int = -1
    """Total memory of the device in bytes, -1 if unknown."""
    t_ns: int = 0


class BubbleStarted(_Msg, frozen=True, tag="bubble_started"):
    """A stage has entered a bubble: its device is idle from ``t_ns``."""

    rank: int
    stage: int
    device: str
    step: int
    """Training step (optimizer step) the bubble belongs to."""
    index: int
    """Position of the bubble within the step, 0-based, in time order."""
    t_ns: int
    expected_ns: int
    """Predicted duration, from the profile or a running estimate."""
    spare_memory: int = -1
    """Bytes of device memory the stage leaves free, -1 if unknown."""


class BubbleEnded(_Msg, frozen=True, tag="bubble_ended"):
    """The stage has left the bubble and computes again."""

    rank: int
    stage: int
    device: str
    step: int
    index: int
    t_ns: int
    duration_ns: int
    """Measured duration of the bubble."""


class StepFinished(_Msg, frozen=True, tag="step_finished"):
    """A training step of this rank has finished."""

    rank: int
    stage: int
    step: int
    t_ns: int
    duration_ns: int
    bubble_ns: int = 0
    """Sum of the measured bubbles of this step."""


class Heartbeat(_Msg, frozen=True, tag="heartbeat"):
    """Sent by a rank that has been quiet for a while, so it is not taken for dead."""

    rank: int
    t_ns: int


class Goodbye(_Msg, frozen=True, tag="goodbye"):
    """Last message of a rank that exits cleanly."""

    rank: int
    t_ns: int
    dropped: int = 0
    """Events the emitter could not send (manager away or slow)."""


BackendEvent = Hello | BubbleStarted | BubbleEnded | StepFinished | Heartbeat | Goodbye


# --------------------------------------------------------------------------
# side tasks: specification shared by control and worker sockets
# --------------------------------------------------------------------------

TaskKind = Literal["iterative", "imperative"]
SidePriority = Literal["low", "same"]
"""CPU priority of side tasks on a CPU device. ``low``: nice 19, so the stage preempts a side step
that runs past a bubble's end (the production default on CPU). ``same``: the stage's own priority,
so such a step delays the stage as it would on a GPU, which does not preempt a running kernel
(the GPU-faithful stand-in that benchmarks use)."""

TaskState = Literal["pending", "starting", "running", "finished", "failed", "cancelled"]

TERMINAL_STATES: frozenset[TaskState] = frozenset({"finished", "failed", "cancelled"})
"""States a task never leaves."""


class TaskSpec(_Msg, frozen=True, tag="task_spec"):
    """What a user submits: a side task and what it needs."""

    kind: TaskKind
    target: str = ""
    """``module:Class`` of an iterative task."""
    argv: list[str] = []
    """Command line of an imperative task."""
    name: str = ""
    options: Options = {}
    peak_memory: int = -1
    """Peak device memory in bytes (declared or profiled), -1 if unknown."""
    step_time_ns: int = -1
    """Profiled step time of an iterative task, -1 if unknown."""
    device: str = ""
    """Pin to this device; empty lets the manager place the task."""
    max_restarts: int = 3
    """How often a crashed task is restarted from its last checkpoint."""


# --------------------------------------------------------------------------
# manager -> worker
# --------------------------------------------------------------------------


class Assign(_Msg, frozen=True, tag="assign"):
    """Tells a freshly started worker what to run and where."""

    task_id: int
    spec: TaskSpec
    device: str
    checkpoint_path: str
    margin_ns: int
    """Safety margin kept free before a bubble's expected end."""
    checkpoint_every_ns: int
    cpu_affinity: list[int] = []
    """Cores the worker pins itself to (those of the stage it shares a device with)."""
    workdir: str = ""
    """Directory for the task's own outputs."""
    memory_limit: int = -1
    """Bytes the task may use at its peak (its declared peak); -1: no cap."""
    side_priority: SidePriority = "low"
    """The CPU priority the worker runs at (see :data:`SidePriority`)."""


class Grant(_Msg, frozen=True, tag="grant"):
    """The worker may start steps until ``deadline_ns``."""

    grant_id: int
    bubble_t_ns: int
    """When the bubble began; latency is measured from here."""
    deadline_ns: int
    """Expected end of the bubble; no step may run past it."""
    probe: bool = False
    """Run one step even if the estimate says it does not fit: the estimate may be stale."""


class Revoke(_Msg, frozen=True, tag="revoke"):
    """The bubble behind a grant has ended: start no further step."""

    grant_id: int


class Stop(_Msg, frozen=True, tag="stop"):
    """Checkpoint and exit."""

    reason: str


ManagerToWorker = Assign | Grant | Revoke | Stop


# --------------------------------------------------------------------------
# worker -> manager
# --------------------------------------------------------------------------


class WorkerReady(_Msg, frozen=True, tag="worker_ready"):
    """The worker has connected; after :class:`Assign`, also that setup is done."""

    protocol_version: int
    task_id: int
    pid: int
    set_up: bool = False
    step_estimate_ns: int = -1
    steps: int = 0
    """Steps already done (restored from a checkpoint)."""


GrantDoneReason = Literal["no_fit", "revoked", "expired", "finished", "stopping"]
"""Why a worker gives a grant back."""


class GrantDone(_Msg, frozen=True, tag="grant_done"):
    """The worker gives a grant back and says what it did with it."""

    task_id: int
    grant_id: int
    steps: int
    busy_ns: int
    """Time spent in steps inside the grant."""
    first_step_delay_ns: int
    """Bubble start to first step start; -1 if no step ran."""
    overrun_ns: int
    """How far the last step ran past the deadline (0 if it did not)."""
    reason: GrantDoneReason
    step_estimate_ns: int = -1
    """What the worker now expects its next step to take."""
    last_step_end_ns: int = 0
    """When the last step inside the grant ended (0 if none ran)."""
    first_step_ns: int = 0
    """When the first step inside the grant started (0 if none ran)."""
    total_steps: int = -1
    """Steps the task has done in all (restored ones included); -1 if not counted."""
    cpu_ns: int = -1
    """The worker process's CPU clock (all threads) when its last step in the grant ended; -1 unknown.

    The manager reads the same clock when the bubble ends: what the process ran
    after that is side work a GPU would have run instead of training (interference).
    """


class Progress(_Msg, frozen=True, tag="progress"):
    """Periodic progress of a task."""

    task_id: int
    steps: int
    metrics: Metrics = {}


class Checkpointed(_Msg, frozen=True, tag="checkpointed"):
    """State saved; a restart resumes from ``steps``."""

    task_id: int
    steps: int
    path: str


class TaskFinished(_Msg, frozen=True, tag="task_finished"):
    """The task has completed its work."""

    task_id: int
    steps: int
    metrics: Metrics = {}


class TaskFailed(_Msg, frozen=True, tag="task_failed"):
    """The task raised; the traceback is for the user's eyes."""

    task_id: int
    error: str
    traceback: str = ""


WorkerToManager = WorkerReady | GrantDone | Progress | Checkpointed | TaskFinished | TaskFailed


# --------------------------------------------------------------------------
# control client <-> manager
# --------------------------------------------------------------------------


class Submit(_Msg, frozen=True, tag="submit"):
    spec: TaskSpec


class Cancel(_Msg, frozen=True, tag="cancel"):
    task_id: int


class StatusRequest(_Msg, frozen=True, tag="status_request"):
    pass


ControlRequest = Submit | Cancel | StatusRequest


class Submitted(_Msg, frozen=True, tag="submitted"):
    task_id: int
    device: str
    """Where it was placed; empty while it waits for a device that fits."""


class Cancelled(_Msg, frozen=True, tag="cancelled"):
    task_id: int


class Rejected(_Msg, frozen=True, tag="rejected"):
    """A request the manager cannot honour, and why."""

    reason: str


class DeviceStatus(_Msg, frozen=True, tag="device_status"):
    device: str
    stage: int
    rank: int
    framework: str
    alive: bool
    bubbles: int
    bubble_ns: int
    """Measured bubble time seen on this device."""
    used_ns: int
    """Side-task step time inside those bubbles."""
    overruns: int
    overrun_ns: int
    spare_memory: int
    steps: int
    """Training steps finished by the rank on this device."""
    dropped: int = 0
    free_memory: int = -1
    """Free device memory as NVML reports it (-1 without NVML)."""
    interference_ns: int = 0
    """Side-task compute that ran while the stage was not in a bubble (what a GPU would take from training)."""
    train_ns: int = 0
    """Wall time the stage has trained here: from its first bubble event to its last (or now)."""


class TaskStatus(_Msg, frozen=True, tag="task_status"):
    task_id: int
    name: str
    kind: TaskKind
    state: TaskState
    device: str
    steps: int
    busy_ns: int
    restarts: int = 0
    metrics: Metrics = {}
    error: str = ""
    pid: int = 0
    device_memory: int = -1
    """Device memory the task's process uses (NVML; -1 unknown)."""
    interference_ns: int = 0
    """This task's compute while its stage was not in a bubble."""


class LatencySummary(_Msg, frozen=True, tag="latency"):
    """Bubble start -> first side-task step start, over the grants seen."""

    count: int
    p50_ns: int
    p99_ns: int
    max_ns: int


class StatusReply(_Msg, frozen=True, tag="status"):
    devices: list[DeviceStatus]
    tasks: list[TaskStatus]
    latency: LatencySummary
    events: int
    """Backend events received."""
    rejected_frames: int
    uptime_ns: int


ControlReply = Submitted | Cancelled | Rejected | StatusReply
