"""The cluster queue's contract: job records and the calls nodes and users make to the queue.

Every call to the queue actor is one :data:`QueueRequest` encoded with
msgpack, answered by one :data:`QueueReply`; Ray only carries the bytes. The
manager's own wire (``freeride.protocol``) is unchanged: a node's agent turns a
leased job into a plain ``Submit`` of its :class:`~freeride.protocol.TaskSpec`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from freeride import protocol as p

__all__ = [
    "JOB_STATES",
    "Accepted",
    "AttemptRecord",
    "CancelJob",
    "FailJob",
    "FinishJob",
    "JobProgress",
    "JobRecord",
    "JobState",
    "MAX_SUBMIT",
    "LeaseJobs",
    "Leased",
    "Leases",
    "NodeRecord",
    "NodeSummary",
    "Outcome",
    "PreemptJob",
    "QueueReply",
    "QueueRequest",
    "QueueStatus",
    "QueueStatusRequest",
    "Refused",
    "RenewLeases",
    "Renewed",
    "Slot",
    "SubmitJobs",
    "Submitted",
    "decode_reply",
    "decode_request",
    "encode",
]

JobState = Literal["queued", "leased", "finished", "failed", "cancelled"]
JOB_STATES: tuple[JobState, ...] = ("queued", "leased", "finished", "failed", "cancelled")
Outcome = Literal["finished", "failed", "preempted", "expired", "cancelled"]
"""How one attempt ended: ``preempted`` (its node gave it back) and ``expired`` (its node stopped renewing
its lease: dead or cut off) put the job back in the queue without counting against ``max_attempts``."""
MAX_SUBMIT = 10_000
"""Jobs one submission may queue."""

_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
_Signature = Annotated[str, msgspec.Meta(max_length=64)]


class _Msg(msgspec.Struct, frozen=True, kw_only=True):
    pass


# -- records -------------------------------------------------------------------------


class AttemptRecord(_Msg, frozen=True, tag="attempt"):
    """One lease of a job, and how it ended."""

    attempt: int
    node: str
    outcome: Outcome
    steps: int = 0
    """Steps the task had made when the attempt ended (as its node last reported)."""
    detail: str = ""


class JobRecord(_Msg, frozen=True, tag="job"):
    """A job as the queue holds it; the queue is the one owner of this record."""

    job_id: int
    spec: p.TaskSpec
    """What each attempt submits to a node's manager; ``spec.name`` is the job's name across the cluster."""
    state: JobState = "queued"
    attempt: int = 0
    """The current (or last) attempt; attempts count from 1."""
    node: str = ""
    """The node holding the lease (``leased``) or the node it finished or failed on."""
    lease_deadline: float = 0.0
    """Queue clock (monotonic seconds) at which an unrenewed lease expires."""
    steps: int = 0
    checkpointed_steps: int = -1
    """Steps in the job's last checkpoint (-1: none known); a new attempt resumes from it."""
    failures: int = 0
    """Attempts that ended in the task's own failure."""
    max_attempts: int = 3
    metrics: dict[str, float] = {}
    error: str = ""
    history: list[AttemptRecord] = []
    lease_token: str = ""
    """The secret of the current lease: only its holder can renew it or say how the attempt ended (the
    queue never shows it in a status)."""
    cancel_requested: bool = False
    """A user cancelled the job while a node held it: the node stops it at its next renewal."""
    signature: str = ""
    """The spec's signature as submitted ("" unsigned); a node with the cluster's secret checks it."""


class Slot(_Msg, frozen=True, tag="slot"):
    """Room for one more job on one of a node's devices."""

    device: str
    spare_memory: int = -1
    """Bytes the device can give a side task (-1: not known, any job fits)."""
    bubble_share: float = 0.0
    """Share of the device's time that is bubble."""


class JobProgress(_Msg, frozen=True, tag="job_progress"):
    """What a node's agent knows of one leased job, sent with each renewal."""

    job_id: int
    attempt: int
    state: p.TaskState
    steps: int = 0
    checkpointed_steps: int = -1
    metrics: dict[str, float] = {}
    token: str = ""
    """The lease's secret, as :class:`Leased` gave it."""


class NodeSummary(_Msg, frozen=True, tag="node_summary"):
    """A node's manager status, summed over its devices (what ``cluster status`` and ``report`` aggregate)."""

    devices: int = 0
    alive_devices: int = 0
    bubble_ns: int = 0
    used_ns: int = 0
    train_ns: int = 0
    interference_ns: int = 0
    tasks_running: int = 0


class NodeRecord(_Msg, frozen=True, tag="node"):
    node: str
    last_seen: float
    """Queue clock of its last lease or renewal."""
    summary: NodeSummary = NodeSummary()
    leases: int = 0


# -- requests ------------------------------------------------------------------------


class SubmitJobs(_Msg, frozen=True, tag="submit_jobs"):
    specs: Annotated[list[p.TaskSpec], msgspec.Meta(max_length=MAX_SUBMIT)]
    max_attempts: int = 3
    signatures: Annotated[list[_Signature], msgspec.Meta(max_length=MAX_SUBMIT)] = []
    """One per spec (``freeride.cluster.signing``), or none: nodes that hold the cluster's secret run only
    signed jobs."""


class CancelJob(_Msg, frozen=True, tag="cancel_job"):
    """A user's cancel: a queued job is never leased; a leased one is stopped by its node (it checkpoints)."""

    job_id: int


class LeaseJobs(_Msg, frozen=True, tag="lease_jobs"):
    """A node offers room; the queue leases it the first queued jobs that fit."""

    node: _Name
    slots: list[Slot]
    lease_s: float
    summary: NodeSummary = NodeSummary()
    kinds: list[p.TaskKind] = msgspec.field(default_factory=lambda: ["iterative"])
    """The kinds of task the node runs from the queue (a program only where its agent allows them)."""


class RenewLeases(_Msg, frozen=True, tag="renew_leases"):
    node: _Name
    progress: list[JobProgress]
    lease_s: float
    summary: NodeSummary = NodeSummary()


class FinishJob(_Msg, frozen=True, tag="finish_job"):
    node: _Name
    job_id: int
    attempt: int
    token: str = ""
    steps: int = 0
    metrics: dict[str, float] = {}


class FailJob(_Msg, frozen=True, tag="fail_job"):
    node: _Name
    job_id: int
    attempt: int
    error: str
    token: str = ""
    steps: int = 0
    final: bool = False
    """The node refused the job itself (its manager rejected the spec): no other attempt can help."""


class PreemptJob(_Msg, frozen=True, tag="preempt_job"):
    node: _Name
    job_id: int
    attempt: int
    reason: str
    token: str = ""
    steps: int = 0
    checkpointed_steps: int = -1


class QueueStatusRequest(_Msg, frozen=True, tag="queue_status_request"):
    pass


QueueRequest = SubmitJobs | CancelJob | LeaseJobs | RenewLeases | FinishJob | FailJob | PreemptJob | QueueStatusRequest


# -- replies ---------------------------------------------------------------------------


class Submitted(_Msg, frozen=True, tag="jobs_submitted"):
    job_ids: list[int]


class Leased(_Msg, frozen=True, tag="leased"):
    job_id: int
    attempt: int
    spec: p.TaskSpec
    checkpointed_steps: int = -1
    token: str = ""
    """The lease's secret: the node sends it with every renewal and with the attempt's outcome."""
    signature: str = ""
    """The spec's signature as submitted ("" unsigned)."""


class Leases(_Msg, frozen=True, tag="leases"):
    leases: list[Leased]


class Renewed(_Msg, frozen=True, tag="renewed"):
    lost: list[int] = []
    """Jobs the node reported but no longer holds (its lease expired): it must stop them."""
    cancel: list[int] = []
    """Jobs a user cancelled: the node stops them and reports them preempted (they end cancelled)."""


class Accepted(_Msg, frozen=True, tag="accepted"):
    duplicate: bool = False
    """The same attempt's outcome was already recorded: nothing changed."""


class Refused(_Msg, frozen=True, tag="refused"):
    reason: str


class QueueStatus(_Msg, frozen=True, tag="queue_status"):
    jobs: list[JobRecord]
    nodes: list[NodeRecord]
    expired: int = 0
    """Leases that ran out (a node died or was cut off) since the queue started."""
    now: float = 0.0
    """The queue's clock when it answered (to age ``NodeRecord.last_seen``)."""


QueueReply = Submitted | Leases | Renewed | Accepted | Refused | QueueStatus

_encoder = msgspec.msgpack.Encoder()
_request_decoder: msgspec.msgpack.Decoder[QueueRequest] = msgspec.msgpack.Decoder(QueueRequest)
_reply_decoder: msgspec.msgpack.Decoder[QueueReply] = msgspec.msgpack.Decoder(QueueReply)


def encode(msg: QueueRequest | QueueReply) -> bytes:
    return _encoder.encode(msg)


def decode_request(frame: bytes) -> QueueRequest:
    """Raises ``msgspec.ValidationError`` or ``msgspec.DecodeError`` on a malformed frame."""
    return _request_decoder.decode(frame)


def decode_reply(frame: bytes) -> QueueReply:
    return _reply_decoder.decode(frame)
