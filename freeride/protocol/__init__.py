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

The modules, one family each: :mod:`~freeride.protocol.base` (the version,
frame limits, bounded field types and the base Struct),
:mod:`~freeride.protocol.backend` (backend events),
:mod:`~freeride.protocol.spec` (a side task's spec and states),
:mod:`~freeride.protocol.worker` (manager <-> worker) and
:mod:`~freeride.protocol.control` (control requests and replies).
"""

from freeride.protocol.backend import BackendEvent, BubbleEnded, BubbleStarted, Goodbye, Heartbeat, Hello, StepFinished
from freeride.protocol.base import (
    I64_MAX,
    MAX_CONTROL_FRAME,
    MAX_ESTIMATE_KINDS,
    MAX_EVENT_FRAME,
    MAX_WORKER_FRAME,
    PROTOCOL_VERSION,
    DeviceKind,
    Metrics,
    Options,
    StepEstimatesSummary,
)
from freeride.protocol.control import (
    Cancel,
    Cancelled,
    ControlReply,
    ControlRequest,
    DeviceStatus,
    LatencySummary,
    Rejected,
    StatusReply,
    StatusRequest,
    Submit,
    Submitted,
    TaskStatus,
    TrainingCost,
)
from freeride.protocol.spec import (
    TERMINAL_STATES,
    IterativeSpec,
    ProgramSpec,
    SidePriority,
    TaskKind,
    TaskSpec,
    TaskState,
)
from freeride.protocol.worker import (
    Arm,
    Assign,
    Checkpointed,
    CheckpointFailed,
    Disarm,
    Grant,
    GrantDone,
    GrantDoneReason,
    Holdback,
    ManagerToWorker,
    Progress,
    Revoke,
    Stop,
    TaskFailed,
    TaskFinished,
    WorkerReady,
    WorkerToManager,
)

__all__ = [
    "I64_MAX",
    "MAX_CONTROL_FRAME",
    "MAX_ESTIMATE_KINDS",
    "MAX_EVENT_FRAME",
    "MAX_WORKER_FRAME",
    "PROTOCOL_VERSION",
    "Arm",
    "Assign",
    "BackendEvent",
    "BubbleEnded",
    "BubbleStarted",
    "Cancel",
    "Cancelled",
    "CheckpointFailed",
    "Checkpointed",
    "ControlReply",
    "ControlRequest",
    "DeviceKind",
    "DeviceStatus",
    "Disarm",
    "Goodbye",
    "Grant",
    "GrantDone",
    "GrantDoneReason",
    "Heartbeat",
    "Hello",
    "Holdback",
    "IterativeSpec",
    "LatencySummary",
    "ManagerToWorker",
    "Metrics",
    "Options",
    "StepEstimatesSummary",
    "ProgramSpec",
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
    "TrainingCost",
    "WorkerReady",
    "WorkerToManager",
]
