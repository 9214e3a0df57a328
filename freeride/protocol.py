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

from typing import Annotated, Literal

import msgspec

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
    "LatencySummary",
    "ManagerToWorker",
    "Metrics",
    "Options",
    "StepEstimatesSummary",
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

PROTOCOL_VERSION = 1
"""Bumped only when a peer of another version could misread a frame."""

# --------------------------------------------------------------------------
# bounds: what a decoder admits. A frame with a value outside them is
# rejected like a malformed one, so no arithmetic in the manager meets an
# integer that msgpack cannot encode again (it stops at 2**64 - 1).
# --------------------------------------------------------------------------

I64_MAX = 2**63 - 1
"""Largest signed 64-bit integer: the ceiling of every time, count and size on the wire."""

MAX_EVENT_FRAME = 64 * 1024
"""Largest backend event frame, in bytes (a Hello with 4096 cores is ~20 kB)."""
MAX_WORKER_FRAME = 4 * 1024 * 1024
"""Largest worker frame (a failure's traceback is the big one)."""
MAX_CONTROL_FRAME = 4 * 1024 * 1024
"""Largest control request (a task's options and command line)."""

_I32_MAX = 2**31 - 1

Nanos = Annotated[int, msgspec.Meta(ge=0, le=I64_MAX)]
"""A monotonic timestamp or a duration, in ns."""
NanosOrUnknown = Annotated[int, msgspec.Meta(ge=-1, le=I64_MAX)]
"""A duration, or -1 for unknown."""
Count = Annotated[int, msgspec.Meta(ge=0, le=I64_MAX)]
"""Steps, events, ids."""
CountOrUnknown = Annotated[int, msgspec.Meta(ge=-1, le=I64_MAX)]
Bytes = Annotated[int, msgspec.Meta(ge=-1, le=I64_MAX)]
"""A size in bytes, or -1 for unknown."""
Small = Annotated[int, msgspec.Meta(ge=0, le=_I32_MAX)]
"""Ranks, stages, pids, cores, versions."""
Position = Annotated[int, msgspec.Meta(ge=-1, le=I64_MAX)]
"""A training step or a bubble's index in it (-1 admitted: before the first step)."""
Name = Annotated[str, msgspec.Meta(max_length=256)]
"""Devices, frameworks, task names, metric keys."""
Text = Annotated[str, msgspec.Meta(max_length=64 * 1024)]
"""Error messages, reasons, paths, targets, one argument."""
LongText = Annotated[str, msgspec.Meta(max_length=1024 * 1024)]
"""A traceback."""
Cores = Annotated[list[Small], msgspec.Meta(max_length=4096)]

Metrics = Annotated[dict[Name, float], msgspec.Meta(max_length=1024)]
"""Named numbers a side task reports (loss, accuracy, images, ...)."""

Options = Annotated[dict[Name, Text | int | float | bool], msgspec.Meta(max_length=1024)]
"""Constructor arguments of a side task: plain scalars only."""

MAX_ESTIMATE_KINDS = 32
"""Step kinds a worker reports estimates of, at most (the status of a task stays small)."""
StepEstimatesSummary = Annotated[dict[Name, NanosOrUnknown], msgspec.Meta(max_length=MAX_ESTIMATE_KINDS)]
"""A task's running step-time estimate per step kind, in ns (-1: not measured yet)."""

DeviceKind = Literal["any", "gpu"]
"""What device a task needs: ``gpu`` is never placed on a CPU device."""


class _Msg(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every message: frozen, keyword-only, tagged by subclasses."""


# --------------------------------------------------------------------------
# backend -> manager
# --------------------------------------------------------------------------


class Hello(_Msg, frozen=True, tag="hello"):
    """First message of a training rank; announces who it is."""

    protocol_version: Small
    rank: Small
    stage: Small
    num_stages: Small
    device: Name
    """Device the stage computes on, e.g. ``cuda:0`` or ``cpu:1``."""
    framework: Name
    """``deepspeed``, ``megatron`` or ``sim``."""
    pid: Small
    cpu_affinity: Cores = []
    """Cores the rank may run on; side tasks of this device are pinned to them."""
    device_memory: Bytes = -1
    """Total memory of the device in bytes, -1 if unknown."""
    t_ns: Nanos = 0
    bubbles_endpoint: Text = ""
    """Where the rank also publishes its :class:`BubbleStarted` events for armed workers ("" none)."""
    job: Name = ""
    """The training job's name, the same on every rank and node (from the launcher's environment; "" unknown):
    the steps held back to measure the job's cost are chosen from it."""


class BubbleStarted(_Msg, frozen=True, tag="bubble_started"):
    """A stage has entered a bubble: its device is idle from ``t_ns``."""

    rank: Small
    stage: Small
    device: Name
    step: Position
    """Training step (optimizer step) the bubble belongs to."""
    index: Position
    """Position of the bubble within the step, 0-based, in time order."""
    t_ns: Nanos
    expected_ns: Nanos
    """Predicted duration, from the profile or a running estimate."""
    spare_memory: Bytes = -1
    """Bytes of device memory the stage leaves free, -1 if unknown."""
    thread: Position = 0
    """Native id of the rank's thread that announced it and now blocks, 0 if unknown: a side worker on
    its core lets it block before the first step (see :mod:`freeride.worker.courtesy`)."""


class BubbleEnded(_Msg, frozen=True, tag="bubble_ended"):
    """The stage has left the bubble and computes again."""

    rank: Small
    stage: Small
    device: Name
    step: Position
    index: Position
    t_ns: Nanos
    duration_ns: Nanos
    """Measured duration of the bubble."""
    waited_runnable_ns: Nanos = 0
    """Of it, how long the stage waited for its core at the end (runnable, not running): on a shared core,
    time a side task's step kept from training (0: none, or not measured)."""


class StepFinished(_Msg, frozen=True, tag="step_finished"):
    """A training step of this rank has finished."""

    rank: Small
    stage: Small
    step: Position
    t_ns: Nanos
    duration_ns: Nanos
    bubble_ns: Nanos = 0
    """Sum of the measured bubbles of this step."""


class Heartbeat(_Msg, frozen=True, tag="heartbeat"):
    """Sent by a rank that has been quiet for a while, so it is not taken for dead."""

    rank: Small
    t_ns: Nanos


class Goodbye(_Msg, frozen=True, tag="goodbye"):
    """Last message of a rank that exits cleanly."""

    rank: Small
    t_ns: Nanos
    dropped: Count = 0
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
    target: Text = ""
    """``module:Class`` of an iterative task."""
    argv: Annotated[list[Text], msgspec.Meta(max_length=4096)] = []
    """Command line of an imperative task."""
    name: Name = ""
    options: Options = {}
    peak_memory: Bytes = -1
    """Peak device memory in bytes (declared or profiled), -1 if unknown."""
    step_time_ns: NanosOrUnknown = -1
    """Profiled step time of an iterative task, -1 if unknown."""
    device: Name = ""
    """Pin to this device; empty lets the manager place the task."""
    max_restarts: Small = 3
    """How often a crashed task is restarted from its last checkpoint."""
    sm_share: Annotated[int, msgspec.Meta(ge=-1, le=100)] = -1
    """Percent of the GPU's SMs the task's process may occupy (MPS active thread
    percentage; 0 and -1: the manager's default, which leaves SMs for the trainer's NCCL kernels)."""
    fill: bool = False
    """A filler: it takes a bubble only once the device's other tasks have given it back, so that a task
    of short steps fills the ends of bubbles that a task of long steps leaves (a mix per device)."""
    device_kind: DeviceKind = "any"
    """The device the task needs (its class's ``device_kind``): a ``gpu`` task waits for a CUDA device."""
    cwd: Text = ""
    """An imperative task's working directory (absolute); empty: the task's own workdir under the state dir."""
    env: Annotated[dict[Name, Text], msgspec.Meta(max_length=4096)] = {}
    """An imperative task's variables, laid over the manager's small base environment
    (see :mod:`freeride.tasks.programs`); never shown in status."""
    sync_every: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    """A PyTorch program synchronizes CUDA every this many optimizer steps (0: never)."""
    progress_file: Text = ""
    """A file an imperative program writes its step (a number) or metrics (a JSON object) to."""
    progress_pattern: Annotated[str, msgspec.Meta(max_length=1024)] = ""
    """A regular expression with named groups matched against each line of the program's stdout."""
    checkpoint_dir: Text = ""
    """An iterative task's checkpoint directory (absolute, existing); empty: the manager's own state dir.
    A directory on storage every node mounts lets a task resume on another node (the cluster queue's jobs)."""


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
    max_loss_ns: Nanos = 0
    """Step time the task may lose to a crash: a checkpoint is forced before more is unsaved (0: no bound)."""
    max_loss_steps: Count = 0
    """Steps the task may lose to a crash, likewise (0: no bound)."""
    warm_up: bool = False
    """No training runs on the device yet: rehearse each step kind before the first bubble, then undo it."""
    estimates_dir: str = ""
    """Directory of the step-time estimates kept across runs (see :mod:`freeride.tasks.estimates`); empty: none kept."""
    bubble_ns: Nanos = 0
    """The device's typical bubble: half its bubble time lies in bubbles at least this long (0: not known yet).

    Tasks that size their own steps size them by it (``TaskContext.bubble_ns``)."""


class Grant(_Msg, frozen=True, tag="grant"):
    """The worker may start steps until ``deadline_ns``."""

    grant_id: int
    bubble_t_ns: int
    """When the bubble began; latency is measured from here."""
    deadline_ns: int
    """Expected end of the bubble; no step may run past it."""
    probe: bool = False
    """Run one step even if the estimate says it does not fit: the estimate may be stale."""
    margin_ns: NanosOrUnknown = -1
    """The device's current safety margin (its interference guard's); -1: the one in :class:`Assign`."""


class Revoke(_Msg, frozen=True, tag="revoke"):
    """The bubble behind a grant has ended: start no further step."""

    grant_id: int


class Stop(_Msg, frozen=True, tag="stop"):
    """Checkpoint and exit."""

    reason: str


_Blocks = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]


class Holdback(_Msg, frozen=True, tag="holdback"):
    """Which steps of a job get no side work, so that its step times measure what side work costs.

    Steps from :attr:`start_step` on are cut into blocks of :attr:`block_steps`, and
    the blocks into cycles of :attr:`every` blocks, doubling every
    :attr:`doubling_cycles` cycles up to :attr:`max_every`; in each cycle one
    block is held back (see :mod:`freeride.serve.holdback`, which owns the rule).
    """

    job: Name = ""
    """The job's name: the held blocks are drawn from it, the same on every node."""
    block_steps: _Blocks = 4
    """Steps per block (the first of each is not measured: side work just before may drain into it)."""
    every: _Blocks = 8
    """Blocks per cycle at first (0: nothing is held back and no cost is measured)."""
    max_every: _Blocks = 32
    """The longest cycle, in blocks."""
    doubling_cycles: _Blocks = 32
    """Cycles after which a cycle doubles in length, until :attr:`max_every`."""
    start_step: _Blocks = 2
    """Steps before this one (the job's warm-up) are never held back nor measured."""

    def __post_init__(self) -> None:
        if self.block_steps < 2:
            raise ValueError(f"block_steps must be >= 2 (a block's first step is not measured), got {self.block_steps}")
        if self.every == 1 or self.every % 2:
            raise ValueError(f"every must be 0 (off) or an even number of blocks, got {self.every}")
        if self.every and (self.max_every < self.every or self.max_every % self.every):
            raise ValueError(f"max_every must be a multiple of every ({self.every}), got {self.max_every}")
        if self.doubling_cycles < 1:
            raise ValueError(f"doubling_cycles must be >= 1, got {self.doubling_cycles}")

    @property
    def enabled(self) -> bool:
        return self.every > 0


class Arm(_Msg, frozen=True, tag="arm"):
    """The next bubble is this worker's: start on the rank's own event, without waiting for a Grant.

    The worker subscribes to ``endpoint`` and treats the first :class:`BubbleStarted`
    after ``after_ns`` as a Grant ``grant_id`` with deadline ``t_ns + expected_ns * prediction_factor``
    (one hop instead of two). The manager sends that Grant too, as soon as it sees
    the same event: a worker that missed the event starts from it, one that did not
    ignores it.
    """

    grant_id: int
    endpoint: str
    """The rank's bubble-start publisher."""
    after_ns: int
    """Start of the last bubble the manager has seen: only a later one is the armed one."""
    margin_ns: int = -1
    """The margin the grant carries (the device's guard sets it; -1: the assigned one)."""
    prediction_factor: float = 1.0
    """What the event's expected length is multiplied by for the deadline (the device's guard sets it)."""
    min_bubble_ns: int = 0
    """A bubble whose length so set is shorter than this is not the armed one: the worker waits for the next."""
    holdback: Holdback | None = None
    """The steps of the rank's job held back to measure its cost: a bubble of one of them is not the armed one."""


class Disarm(_Msg, frozen=True, tag="disarm"):
    """The arm ``grant_id`` is withdrawn (the task is stopping or its rank left)."""

    grant_id: int


ManagerToWorker = Assign | Grant | Revoke | Stop | Arm | Disarm


# --------------------------------------------------------------------------
# worker -> manager
# --------------------------------------------------------------------------


class WorkerReady(_Msg, frozen=True, tag="worker_ready"):
    """The worker has connected; after :class:`Assign`, also that setup is done."""

    protocol_version: Small
    task_id: Count
    pid: Small
    set_up: bool = False
    step_estimate_ns: NanosOrUnknown = -1
    steps: Count = 0
    """Steps already done (restored from a checkpoint)."""
    packs: bool = False
    """The task chooses smaller pieces for what is left of a bubble (``IterativeTask.fit_piece``)."""


GrantDoneReason = Literal["no_fit", "revoked", "expired", "finished", "stopping", "idle"]
"""Why a worker gives a grant back."""


class GrantDone(_Msg, frozen=True, tag="grant_done"):
    """The worker gives a grant back and says what it did with it."""

    task_id: Count
    grant_id: Count
    steps: Count
    busy_ns: Nanos
    """Time spent in steps inside the grant."""
    first_step_delay_ns: NanosOrUnknown
    """Bubble start to first step start; -1 if no step ran."""
    overrun_ns: Nanos
    """How far the last step ran past the deadline (0 if it did not)."""
    reason: GrantDoneReason
    step_estimate_ns: NanosOrUnknown = -1
    """What the worker now expects its next step to take."""
    last_step_end_ns: Nanos = 0
    """When the last step inside the grant ended (0 if none ran)."""
    first_step_ns: Nanos = 0
    """When the first step inside the grant started (0 if none ran)."""
    total_steps: CountOrUnknown = -1
    """Steps the task has done in all (restored ones included); -1 if not counted."""
    cpu_ns: NanosOrUnknown = -1
    """The worker process's CPU clock (all threads) when its last step in the grant ended; -1 unknown.

    The manager reads the same clock when the bubble ends: what the process ran
    after that is side work a GPU would have run instead of training (interference).
    """
    armed: bool = False
    """The grant started from the rank's own event (an :class:`Arm`), not from the manager's Grant."""
    cpu_at_start_ns: NanosOrUnknown = -1
    """The process's CPU clock when it took an armed grant (the manager could not read it then); -1 unknown."""


class Progress(_Msg, frozen=True, tag="progress"):
    """Periodic progress of a task."""

    task_id: Count
    steps: Count
    metrics: Metrics = {}
    estimates: StepEstimatesSummary = {}
    """The running estimate per step kind (the most recently used kinds when there are many)."""
    waiting: bool = False
    """The task is awaiting its own input between steps (it holds no bubble meanwhile)."""


class Checkpointed(_Msg, frozen=True, tag="checkpointed"):
    """State saved; a restart resumes from ``steps``."""

    task_id: Count
    steps: Count
    path: Text


class CheckpointFailed(_Msg, frozen=True, tag="checkpoint_failed"):
    """Saving the state failed (a full disk, say); the worker goes on and retries."""

    task_id: Count
    steps: Count
    """The steps that are unsaved."""
    error: Text


class TaskFinished(_Msg, frozen=True, tag="task_finished"):
    """The task has completed its work."""

    task_id: Count
    steps: Count
    metrics: Metrics = {}


class TaskFailed(_Msg, frozen=True, tag="task_failed"):
    """The task raised; the traceback is for the user's eyes."""

    task_id: Count
    error: Text
    traceback: LongText = ""
    final: bool = False
    """The task cannot run at all (its ``__init__`` or ``setup`` raised): no restart would help."""


WorkerToManager = WorkerReady | GrantDone | Progress | Checkpointed | TaskFinished | TaskFailed | CheckpointFailed


# --------------------------------------------------------------------------
# control client <-> manager
# --------------------------------------------------------------------------


class Submit(_Msg, frozen=True, tag="submit"):
    spec: TaskSpec


class Cancel(_Msg, frozen=True, tag="cancel"):
    task_id: Count


class StatusRequest(_Msg, frozen=True, tag="status_request"):
    pass


ControlRequest = Submit | Cancel | StatusRequest


class Submitted(_Msg, frozen=True, tag="submitted"):
    task_id: int
    device: str
    """Where it was placed; empty while it waits for a device that fits."""


class Cancelled(_Msg, frozen=True, tag="cancelled"):
    task_id: int
    kind: TaskKind = "iterative"
    """What was cancelled: an iterative task keeps its checkpoint, a program has none."""


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
    armed_grants: int = 0
    """Grants whose first step started on the rank's own event (one hop), not on the manager's Grant."""
    margin_ns: int = -1
    """The safety margin grants carry now (set by the device's interference guard); -1 unknown."""
    prediction_factor: float = 1.0
    """What each bubble's expected length is multiplied by when a grant's deadline is set."""
    min_bubble_ns: int = 0
    """Bubbles expected (factor applied) to be shorter get no grant: the guard found them too costly."""
    left_out: int = 0
    """Bubbles so left out."""
    guard_reason: str = ""
    """Why the margin and factor are what they are, in one line."""
    no_bubbles: str = ""
    """Why this device has no pipeline bubbles, e.g. ``no pipeline bubbles: pipeline size 1`` ("" when it has)."""
    typical_bubble_ns: int = 0
    """Half the bubble time lies in bubbles at least this long (0: not known yet); tasks size their steps by it."""
    held_back_ns: int = 0
    """Bubble time held back from side work to measure the training job's cost."""
    backed_off_ns: int = 0
    """Bubble time left out to keep the job's measured cost within the slowdown budget."""

    @property
    def offered_ns(self) -> int:
        """Bubble time offered to side tasks: what was neither held back nor backed off."""
        return max(0, self.bubble_ns - self.held_back_ns - self.backed_off_ns)


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
    hangs: int = 0
    """Steps detected hung (the task was killed and restarted from its checkpoint)."""
    backoff_s: float = 0.0
    """Delay before the latest restart (doubles per restart, bounded)."""
    checkpointed_steps: int = -1
    """Steps in the last saved checkpoint (-1: none yet)."""
    checkpoint_error: str = ""
    """Why the last checkpoint write failed ("" after a good one); it is retried."""
    max_loss_steps: int = 0
    """The most steps a crash may lose (0: bounded by time or not at all)."""
    max_loss_ns: int = 0
    """The most step time a crash may lose (0: bounded by steps or not at all)."""
    memory_cap: int = -1
    """Bytes the task's processes may use (-1: uncapped)."""
    memory_cap_by: str = ""
    """What enforces ``memory_cap``: cgroup2, cgroup1, rlimit_as, mps, torch_fraction."""
    sm_share: int = -1
    """Percent of the GPU's SMs the task's process may occupy under MPS (-1: not capped)."""
    fill: bool = False
    """The task fills the ends of bubbles its device's other tasks give back (``TaskSpec.fill``)."""
    moves: int = 0
    """Times the task moved (checkpoint, then resume) to a device with more bubble time."""
    traceback: str = ""
    """The last lines of the traceback behind ``error`` (a failed task's)."""
    estimates: dict[str, int] = {}
    """The task's step-time estimate per step kind, in ns (-1: not measured yet)."""
    no_fit: int = 0
    """Bubbles the task was kept out of because its estimated step did not fit what was left."""
    no_fit_reason: str = ""
    """Why, the last time it was kept out."""
    pending_reason: str = ""
    """Why a pending task waits for a device."""
    waiting: bool = False
    """The task awaits its own input between steps and gives its bubbles back meanwhile."""


class LatencySummary(_Msg, frozen=True, tag="latency"):
    """Bubble start -> first side-task step start, over the grants seen."""

    count: int
    p50_ns: int
    p99_ns: int
    max_ns: int


class TrainingCost(_Msg, frozen=True, tag="training_cost"):
    """What side work costs a training job, measured on its own step times (see :mod:`freeride.serve.meter`).

    ``slowdown``, ``low`` and ``high`` are shares (0.0021: +0.21 %), over the pairs
    measured since the harvest level was last set.
    """

    job: str
    steps: int
    """Training steps the job has run."""
    pairs: int
    """Held-back / harvested pairs behind the figures below (0: none yet)."""
    slowdown: float = 0.0
    low: float = 0.0
    high: float = 0.0
    coverage: float = 0.0
    """The interval's guaranteed coverage (below the confidence while there are too few pairs)."""
    confidence: float = 0.95
    held_share: float = 0.0
    """Share of the job's steps now held back to measure it."""
    harvest_share: float = 1.0
    """Share of bubbles granted (below 1 while the slowdown budget backs harvesting off)."""
    budget: float = 0.0
    """The slowdown the job may pay (0: no budget)."""
    reason: str = ""
    """Why harvesting is backed off ("" when it is not)."""
    recent: list[float] = []
    """The pairs' figures behind the interval, oldest first (a client may pool several jobs' figures)."""


class StatusReply(_Msg, frozen=True, tag="status"):
    devices: list[DeviceStatus]
    tasks: list[TaskStatus]
    latency: LatencySummary
    events: int
    """Backend events received."""
    rejected_frames: int
    uptime_ns: int
    costs: list[TrainingCost] = []
    """Each training job's measured cost."""


ControlReply = Submitted | Cancelled | Rejected | StatusReply
