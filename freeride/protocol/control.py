"""Control client <-> manager: submit, cancel and inspect side tasks, and the status the manager replies with."""

from __future__ import annotations

from freeride.protocol.base import Count, Message, Metrics, Text
from freeride.protocol.spec import TaskKind, TaskSpec, TaskState

__all__ = [
    "Cancel",
    "Cancelled",
    "ControlReply",
    "ControlRequest",
    "DeviceStatus",
    "LatencySummary",
    "Rejected",
    "StatusReply",
    "StatusRequest",
    "Submit",
    "Submitted",
    "TaskStatus",
    "TrainingCost",
]


class Submit(Message, frozen=True, tag="submit"):
    spec: TaskSpec


class Cancel(Message, frozen=True, tag="cancel"):
    task_id: Count


class StatusRequest(Message, frozen=True, tag="status_request"):
    pass


ControlRequest = Submit | Cancel | StatusRequest


class Submitted(Message, frozen=True, tag="submitted"):
    task_id: int
    device: str
    """Where it was placed; empty while it waits for a device that fits."""


class Cancelled(Message, frozen=True, tag="cancelled"):
    task_id: int
    kind: TaskKind = "iterative"
    """What was cancelled: an iterative task keeps its checkpoint, a program has none."""


class Rejected(Message, frozen=True, tag="rejected"):
    """A request the manager cannot honour, and why."""

    reason: str


class DeviceStatus(Message, frozen=True, tag="device_status"):
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
    gpu_uuid: str = ""
    """NVML's ``GPU-...`` UUID of this device ("" on a CPU device or without NVML): joins it with other GPU metrics."""
    gate: str = ""
    """How side work is released here: "" on the host (no device gate); else the device gate's state in a line."""

    @property
    def offered_ns(self) -> int:
        """Bubble time offered to side tasks: what was neither held back nor backed off."""
        return max(0, self.bubble_ns - self.held_back_ns - self.backed_off_ns)


class TaskStatus(Message, frozen=True, tag="task_status"):
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
    restart_reason: Text = ""
    """Why the task last restarted ("" never)."""
    lost_steps: Count = 0
    """Steps done after the checkpoint a restart resumed from: lost, and done again."""
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
    """The task fills the ends of bubbles its device's other tasks give back (``IterativeSpec.fill``)."""
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


class LatencySummary(Message, frozen=True, tag="latency"):
    """Bubble start -> first side-task step start, over the grants seen."""

    count: int
    p50_ns: int
    p99_ns: int
    max_ns: int


class TrainingCost(Message, frozen=True, tag="training_cost"):
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


class StatusReply(Message, frozen=True, tag="status"):
    devices: list[DeviceStatus]
    tasks: list[TaskStatus]
    latency: LatencySummary
    events: int
    """Backend events received."""
    rejected_frames: int
    uptime_ns: int
    costs: list[TrainingCost] = []
    """Each training job's measured cost."""
    manager_cores: Text = ""
    """Where the manager's own threads run beside the training ranks, and why ("": no rank trains here)."""


ControlReply = Submitted | Cancelled | Rejected | StatusReply
