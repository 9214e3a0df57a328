"""Manager <-> side-task worker: the manager grants bubble time, the worker reports what it did with it."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from freeride.protocol.base import (
    Count,
    CountOrUnknown,
    LongText,
    Message,
    Metrics,
    Name,
    Nanos,
    NanosOrUnknown,
    Small,
    StepEstimatesSummary,
    Text,
)
from freeride.protocol.spec import IterativeSpec, SidePriority

__all__ = [
    "Arm",
    "Assign",
    "CheckpointFailed",
    "Checkpointed",
    "Disarm",
    "Grant",
    "GrantDone",
    "GrantDoneReason",
    "Holdback",
    "ManagerToWorker",
    "Progress",
    "Revoke",
    "Stop",
    "TaskFailed",
    "TaskFinished",
    "WorkerReady",
    "WorkerToManager",
]

# --------------------------------------------------------------------------
# manager -> worker
# --------------------------------------------------------------------------


class Assign(Message, frozen=True, tag="assign"):
    """Tells a freshly started worker what to run and where."""

    task_id: int
    spec: IterativeSpec
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
    gate_path: Text = ""
    """The device's bubble gate page (``freeride serve --device-gate`` on a CUDA device; "" none): the worker
    probes it and, where it works, queues an armed step ahead behind its slot (:mod:`freeride.worker.gated`)."""


class Grant(Message, frozen=True, tag="grant"):
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


class Revoke(Message, frozen=True, tag="revoke"):
    """The bubble behind a grant has ended: start no further step."""

    grant_id: int


class Stop(Message, frozen=True, tag="stop"):
    """Checkpoint and exit."""

    reason: str


_Blocks = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
_Share = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class Holdback(Message, frozen=True, tag="holdback"):
    """Which steps of a job get no side work, so that its step times measure what side work costs.

    Steps from :attr:`start_step` on are cut into blocks of :attr:`block_steps`, and
    the blocks into cycles of :attr:`every` blocks, doubling every
    :attr:`doubling_cycles` cycles up to :attr:`max_every`; in each cycle one
    block is held back (see :mod:`freeride.holdback`, which owns the rule).
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


class Arm(Message, frozen=True, tag="arm"):
    """The next bubble is this worker's: start on the rank's own event, without waiting for a Grant.

    The worker subscribes to ``endpoint`` and treats the first :class:`BubbleStarted`
    after ``after_ns`` as a Grant ``grant_id`` with deadline ``t_ns + expected_ns * prediction_factor``
    (one hop instead of two), ended by the rank's next :class:`BubbleEnded` as by a
    Revoke. Until the worker has shown it hears the rank, the manager sends that
    Grant too, as soon as it sees the same event: a worker that missed the event
    starts from it, one that did not ignores it.
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
    harvest_share: _Share = 1.0
    """The share of the job's bubbles its slowdown budget lets be granted: a bubble it leaves out
    (:func:`freeride.holdback.granted`) is not the armed one."""
    gate_slot: Small = 0
    """The worker's slot of the device's bubble gate (0: none): it may queue its next step behind it now,
    and the rank's stream opens the slot where the device reaches the armed bubble."""
    gate_open_ns: Nanos = 0
    """The rank opens the slot only at a bubble expected (as announced) to last at least this long: it is
    not the armed one otherwise."""


class Disarm(Message, frozen=True, tag="disarm"):
    """The arm ``grant_id`` is withdrawn (the task is stopping or its rank left)."""

    grant_id: int


ManagerToWorker = Assign | Grant | Revoke | Stop | Arm | Disarm


# --------------------------------------------------------------------------
# worker -> manager
# --------------------------------------------------------------------------


class WorkerReady(Message, frozen=True, tag="worker_ready"):
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
    gate: Text = ""
    """Whether the device's bubble gate works for this worker: ``ready``, or why not ("": none assigned)."""


GrantDoneReason = Literal["no_fit", "revoked", "expired", "finished", "stopping", "idle"]
"""Why a worker gives a grant back."""


class GrantDone(Message, frozen=True, tag="grant_done"):
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
    last_step_start_ns: Nanos = 0
    """When the last step inside the grant started (0 if none ran, or unknown)."""
    cpu_at_last_step_ns: NanosOrUnknown = -1
    """The process's CPU clock when that step started; -1 unknown.

    Where the manager handled the bubble's end after this report, the step's
    CPU time past the end is what it ran beyond the wall time it had inside the
    bubble (see :meth:`freeride.serve.ledger.DeviceLedger.settle`).
    """


class Progress(Message, frozen=True, tag="progress"):
    """Periodic progress of a task."""

    task_id: Count
    steps: Count
    metrics: Metrics = {}
    estimates: StepEstimatesSummary = {}
    """The running estimate per step kind (the most recently used kinds when there are many)."""
    waiting: bool = False
    """The task is awaiting its own input between steps (it holds no bubble meanwhile)."""


class Checkpointed(Message, frozen=True, tag="checkpointed"):
    """State saved; a restart resumes from ``steps``."""

    task_id: Count
    steps: Count
    path: Text


class CheckpointFailed(Message, frozen=True, tag="checkpoint_failed"):
    """Saving the state failed (a full disk, say); the worker goes on and retries."""

    task_id: Count
    steps: Count
    """The steps that are unsaved."""
    error: Text


class TaskFinished(Message, frozen=True, tag="task_finished"):
    """The task has completed its work."""

    task_id: Count
    steps: Count
    metrics: Metrics = {}


class TaskFailed(Message, frozen=True, tag="task_failed"):
    """The task raised; the traceback is for the user's eyes."""

    task_id: Count
    error: Text
    traceback: LongText = ""
    final: bool = False
    """The task cannot run at all (its ``__init__`` or ``setup`` raised): no restart would help."""


WorkerToManager = WorkerReady | GrantDone | Progress | Checkpointed | TaskFinished | TaskFailed | CheckpointFailed
