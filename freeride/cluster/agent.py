"""A node's agent: leases cluster jobs that fit its manager's bubbles and runs them there.

``freeride cluster join`` runs one beside each node's ``freeride serve``. Each
tick it reads the manager's status, reports how its jobs ended (finished,
failed, stopped), renews the leases of those still running with their
progress and checkpoint, and leases as many queued jobs as its devices have
room for (:func:`~freeride.cluster.offer.offer`), submitting each to the
manager as an ordinary task. A lease the queue says is lost (it expired while
this node was cut off) is cancelled here, so that it does not run twice for
long; so is a job a user cancelled. On stop it cancels its jobs (they
checkpoint) and gives them back. Programs (arbitrary commands) it runs only
when its node allows them (``freeride cluster join --allow-programs``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from freeride import protocol as p
from freeride.cluster import messages as m
from freeride.cluster.offer import OfferPolicy, offer, summarize
from freeride.cluster.queue import ClusterQueue, QueueUnreachable
from freeride.cluster.signing import SECRET_FILE, verify
from freeride.transport import ControlClient, ManagerUnreachable

__all__ = ["Agent", "AgentConfig"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentConfig:
    """What a node's agent needs, validated at construction."""

    node: str
    """This node's name in the queue (unique in the cluster; the host name by default)."""
    lease_s: float = 30.0
    """A lease not renewed for this long expires, and its job goes back to the queue."""
    poll_s: float = 1.0
    """Seconds between two ticks (status, renewals, leases)."""
    policy: OfferPolicy = field(default_factory=OfferPolicy)
    """How many jobs each device takes."""
    allow_programs: bool = False
    """Run imperative jobs (a command line, run as this agent's manager's user) from the queue too."""
    secret: bytes | None = field(default=None, repr=False)
    """The cluster's shared secret (``freeride.cluster.signing``): only jobs signed with it run here (``None``: any)."""

    @property
    def kinds(self) -> list[p.TaskKind]:
        return ["iterative", "imperative"] if self.allow_programs else ["iterative"]

    def __post_init__(self) -> None:
        if not self.node or len(self.node) > 256:
            raise ValueError(f"node must be a name of 1..256 characters, got {self.node!r}")
        if self.poll_s <= 0:
            raise ValueError(f"poll_s must be > 0, got {self.poll_s}")
        if self.lease_s < 3 * self.poll_s:
            raise ValueError(
                f"lease_s must be at least 3 ticks ({3 * self.poll_s:g}s), got {self.lease_s:g}s: a lease is renewed"
                " once a tick"
            )


@dataclass(kw_only=True, slots=True)
class _Held:
    """A leased job this node submitted to its manager."""

    lease: m.Leased
    task_id: int
    steps: int = 0
    checkpointed_steps: int = -1


class Agent:
    """Runs cluster jobs on one node; ``agent.run(stop)`` until ``stop`` is set."""

    def __init__(self, config: AgentConfig, queue: ClusterQueue, control: ControlClient) -> None:
        self.config = config
        self._queue = queue
        self._control = control
        self._held: dict[int, _Held] = {}

    @property
    def held(self) -> list[int]:
        """Jobs this node runs now."""
        return sorted(self._held)

    def run(self, stop: threading.Event) -> None:
        """Tick until ``stop`` is set, then give every held job back."""
        logger.info("[cluster] node %s: joined; lease %gs", self.config.node, self.config.lease_s)
        try:
            while not stop.is_set():
                try:
                    self.tick()
                except QueueUnreachable as exc:  # its leases will expire if this lasts; keep trying
                    logger.warning("[cluster] node %s: %s", self.config.node, exc)
                stop.wait(self.config.poll_s)
        finally:
            self.release()

    def tick(self) -> None:
        """One round: settle ended jobs, renew the rest, lease what fits."""
        try:
            status = self._status()
        except ManagerUnreachable as exc:
            # no renewals: if the manager stays away, the queue gives the jobs to other nodes
            logger.warning("[cluster] node %s: manager unreachable, renewing nothing: %s", self.config.node, exc)
            return
        self._settle(status)
        self._renew(status)
        slots = offer(status, self.config.policy)
        if slots:
            reply = self._queue.request(
                m.LeaseJobs(
                    node=self.config.node,
                    slots=slots,
                    lease_s=self.config.lease_s,
                    summary=summarize(status),
                    kinds=self.config.kinds,
                )
            )
            if isinstance(reply, m.Leases):
                for lease in reply.leases:
                    self._start(lease)
            else:
                logger.warning("[cluster] node %s: lease refused: %s", self.config.node, reply)

    def release(self) -> None:
        """Cancel every held job (each checkpoints first) and give it back to the queue."""
        for job_id, held in list(self._held.items()):
            steps, checkpointed = held.steps, held.checkpointed_steps
            try:
                reply = self._control.request(p.Cancel(task_id=held.task_id))
                if not isinstance(reply, p.Cancelled):
                    logger.warning("[shutdown] job %d: cancel answered %r", job_id, reply)
                task = self._task(self._status(), held.task_id)
                if task is not None:
                    steps, checkpointed = task.steps, max(checkpointed, task.checkpointed_steps)
            except ManagerUnreachable as exc:
                logger.warning("[shutdown] job %d: manager unreachable: %s", job_id, exc)
            try:
                self._report(
                    m.PreemptJob(
                        node=self.config.node,
                        job_id=job_id,
                        attempt=held.lease.attempt,
                        token=held.lease.token,
                        reason=f"{self.config.node} left the cluster",
                        steps=steps,
                        checkpointed_steps=checkpointed,
                    )
                )
            except QueueUnreachable as exc:  # its lease expires instead
                logger.warning("[shutdown] job %d not given back: %s", job_id, exc)
            del self._held[job_id]
        logger.info("[shutdown] node %s: left the cluster", self.config.node)

    # -- one tick -------------------------------------------------------------------

    def _status(self) -> p.StatusReply:
        reply = self._control.request(p.StatusRequest())
        if not isinstance(reply, p.StatusReply):
            raise ManagerUnreachable(f"the manager answered a status request with {type(reply).__name__}")
        return reply

    @staticmethod
    def _task(status: p.StatusReply, task_id: int) -> p.TaskStatus | None:
        return next((t for t in status.tasks if t.task_id == task_id), None)

    def _settle(self, status: p.StatusReply) -> None:
        """Tell the queue how each job that ended here ended."""
        node = self.config.node
        for job_id, held in list(self._held.items()):
            task = self._task(status, held.task_id)
            attempt, token = held.lease.attempt, held.lease.token
            if task is not None:
                held.steps, held.checkpointed_steps = task.steps, max(held.checkpointed_steps, task.checkpointed_steps)
            request: m.QueueRequest
            if task is None:
                request = m.PreemptJob(
                    node=node, job_id=job_id, attempt=attempt, token=token, reason="its task left the manager's table",
                    steps=held.steps, checkpointed_steps=held.checkpointed_steps,
                )  # fmt: skip
            elif task.state == "finished":
                request = m.FinishJob(
                    node=node, job_id=job_id, attempt=attempt, token=token, steps=task.steps, metrics=task.metrics
                )
            elif task.state == "failed":
                request = m.FailJob(
                    node=node, job_id=job_id, attempt=attempt, token=token, error=task.error, steps=task.steps
                )
            elif task.state == "cancelled":
                request = m.PreemptJob(
                    node=node, job_id=job_id, attempt=attempt, token=token, reason=f"cancelled on {node}",
                    steps=task.steps, checkpointed_steps=held.checkpointed_steps,
                )  # fmt: skip
            else:
                continue
            self._report(request)
            del self._held[job_id]

    def _report(self, request: m.QueueRequest) -> None:
        reply = self._queue.request(request)
        if isinstance(reply, m.Refused):
            # a lease that expired while this node was cut off: another attempt owns the job now
            logger.warning("[cluster] node %s: %s refused: %s", self.config.node, type(request).__name__, reply.reason)
        else:
            logger.info("[cluster] node %s: %s", self.config.node, request)

    def _renew(self, status: p.StatusReply) -> None:
        progress = [
            m.JobProgress(
                job_id=job_id,
                attempt=held.lease.attempt,
                token=held.lease.token,
                state="running",
                steps=held.steps,
                checkpointed_steps=held.checkpointed_steps,
            )
            for job_id, held in self._held.items()
        ]
        reply = self._queue.request(
            m.RenewLeases(
                node=self.config.node, progress=progress, lease_s=self.config.lease_s, summary=summarize(status)
            )
        )
        if not isinstance(reply, m.Renewed):
            logger.warning("[cluster] node %s: renewal refused: %s", self.config.node, reply)
            return
        for job_id in reply.lost:
            held = self._held.pop(job_id, None)
            if held is None:
                continue
            logger.warning("[cluster] node %s: lost the lease of job %d; stopping its task", self.config.node, job_id)
            self._control.request(p.Cancel(task_id=held.task_id))
        for job_id in reply.cancel:
            cancelled = self._held.get(job_id)
            if cancelled is not None:  # stays held: its end is settled (and reported) at a later tick
                logger.info("[cluster] node %s: job %d cancelled by a user; stopping it", self.config.node, job_id)
                self._control.request(p.Cancel(task_id=cancelled.task_id))

    def _give_back(self, lease: m.Leased, reason: str) -> None:
        """The job goes back to the queue, not counted against it (this node could not run it now)."""
        node = self.config.node
        self._report(
            m.PreemptJob(node=node, job_id=lease.job_id, attempt=lease.attempt, token=lease.token, reason=reason)
        )

    def _fail(self, lease: m.Leased, error: str, *, final: bool = False) -> None:
        node = self.config.node
        self._report(
            m.FailJob(
                node=node, job_id=lease.job_id, attempt=lease.attempt, token=lease.token, error=error, final=final
            )
        )

    def _start(self, lease: m.Leased) -> None:
        node = self.config.node
        spec = lease.spec
        if self.config.secret is not None and not verify(spec, lease.signature, self.config.secret):
            how = "unsigned" if not lease.signature else "not signed with this cluster's secret (or changed since)"
            self._fail(
                lease,
                f"{node} runs only jobs signed with the cluster's secret, and this one is {how}: queue it with"
                f" `freeride cluster submit` where {SECRET_FILE} is",
                final=True,
            )
            return
        if spec.kind not in self.config.kinds:
            self._give_back(
                lease, f"{node} runs no programs from the queue (its agent was started without --allow-programs)"
            )
            return
        if isinstance(spec, p.IterativeSpec) and spec.checkpoint_dir:
            try:
                Path(spec.checkpoint_dir).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                self._fail(lease, f"{node} cannot create checkpoint_dir: {exc}")
                return
        try:
            reply = self._control.request(p.Submit(spec=spec))
        except ManagerUnreachable as exc:
            self._give_back(lease, f"manager unreachable: {exc}")
            return
        match reply:
            case p.Submitted(task_id=task_id):
                self._held[lease.job_id] = _Held(
                    lease=lease, task_id=task_id, checkpointed_steps=lease.checkpointed_steps
                )
                logger.info(
                    "[cluster] node %s: job %d (%s) attempt %d is task %d%s",
                    node,
                    lease.job_id,
                    spec.name,
                    lease.attempt,
                    task_id,
                    f", resuming from step {lease.checkpointed_steps}" if lease.checkpointed_steps > 0 else "",
                )
            case p.Rejected(reason=reason):  # the spec itself: every node's manager would reject it the same way
                self._fail(lease, f"{node} rejected it: {reason}", final=True)
            case _:
                self._give_back(lease, f"manager answered {reply!r}")
