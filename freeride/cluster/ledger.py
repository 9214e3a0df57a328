"""The cluster queue's accounting, without Ray: who holds which job, and how each attempt ended.

One :class:`Ledger` is the one owner of every job's state (the queue actor
holds it; tests drive it directly with a fake clock). Its rules:

- A job is leased to one node at a time, as a numbered attempt with a
  deadline; the node renews it with progress while its manager runs the task.
- An outcome (finished, failed, preempted) counts only from the attempt that
  holds the lease. The same attempt reporting it again is a harmless
  duplicate; any other attempt is refused. So a job is finished exactly once,
  even when a node that was cut off comes back and reports late.
- A lease not renewed by its deadline expires (its node died or was cut off):
  the job goes back to the queue and the next attempt resumes from its last
  checkpoint. Expiry and preemption are not the job's fault and do not count
  against ``max_attempts``; the task's own failures do. A node whose manager
  rejects the spec itself fails the job at once: no attempt elsewhere can help.
- Each lease carries a secret token, sent only to the node that leased it:
  renewals and outcomes without it are refused, so another Ray driver cannot
  finish, fail or give back a job it does not run (status never shows tokens).
- A user's cancel ends a queued job at once; a leased one is stopped by its
  node at its next renewal and ends ``cancelled`` when the node gives it back
  (or its lease expires).
- A node leases only the kinds of task it runs from the queue: programs
  (arbitrary commands) only where its agent allows them.
"""

from __future__ import annotations

import collections
import hmac
import secrets
import time
from collections.abc import Callable, Sequence
from typing import assert_never

import msgspec

from freeride import protocol as p
from freeride.cluster import messages as m

__all__ = ["MAX_JOBS", "Ledger", "fits"]

MAX_JOBS = 100_000
"""Jobs one queue holds, finished ones included."""


def fits(spec: p.TaskSpec, slot: m.Slot) -> bool:
    """Whether a job can run in ``slot``: the device's kind, and its spare memory holds the job's peak."""
    if spec.device_kind == "gpu" and not slot.device.startswith("cuda"):
        return False
    return spec.peak_memory < 0 or slot.spare_memory < 0 or spec.peak_memory <= slot.spare_memory


class Ledger:
    """Every job of the cluster queue and every node that leased one."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._jobs: dict[int, m.JobRecord] = {}
        self._names: set[str] = set()
        self._nodes: dict[str, m.NodeRecord] = {}
        self._next_id = 1
        self._expired = 0

    def handle(self, request: m.QueueRequest) -> m.QueueReply:
        """Answer one request (the actor's one entry point)."""
        self.expire()
        match request:
            case m.SubmitJobs():
                return self.submit(request)
            case m.CancelJob():
                return self.cancel(request)
            case m.LeaseJobs():
                return self.lease(request)
            case m.RenewLeases():
                return self.renew(request)
            case m.FinishJob():
                return self.finish(request)
            case m.FailJob():
                return self.fail(request)
            case m.PreemptJob():
                return self.preempt(request)
            case m.QueueStatusRequest():
                return self.status()
            case _:
                assert_never(request)

    # -- users ------------------------------------------------------------------------

    def submit(self, request: m.SubmitJobs) -> m.Submitted | m.Refused:
        names = [spec.name for spec in request.specs]
        if not names:
            return m.Refused(reason="no jobs given")
        if request.max_attempts < 1:
            return m.Refused(reason=f"max_attempts must be >= 1, got {request.max_attempts}")
        if "" in names:
            return m.Refused(reason="every job needs a name (it keys the job's checkpoint on every node)")
        counts = collections.Counter(names)
        taken = sorted({n for n in counts if n in self._names or counts[n] > 1})
        if taken:
            shown = ", ".join(taken[:5]) + (" ..." if len(taken) > 5 else "")
            return m.Refused(reason=f"job names already in the queue or given twice: {shown}; pick another --name")
        if request.signatures and len(request.signatures) != len(names):
            return m.Refused(reason=f"{len(request.signatures)} signatures for {len(names)} jobs")
        if len(self._jobs) + len(names) > MAX_JOBS:
            return m.Refused(reason=f"the queue holds at most {MAX_JOBS} jobs; {len(self._jobs)} are in it")
        ids = []
        signatures = request.signatures or [""] * len(names)
        for spec, signature in zip(request.specs, signatures, strict=True):
            job = m.JobRecord(job_id=self._next_id, spec=spec, max_attempts=request.max_attempts, signature=signature)
            self._jobs[job.job_id] = job
            self._names.add(spec.name)
            ids.append(job.job_id)
            self._next_id += 1
        return m.Submitted(job_ids=ids)

    def cancel(self, request: m.CancelJob) -> m.Accepted | m.Refused:
        job = self._jobs.get(request.job_id)
        if job is None:
            return m.Refused(reason=f"no job {request.job_id} in the queue")
        if job.state == "queued":
            self._jobs[job.job_id] = msgspec.structs.replace(job, state="cancelled")
            return m.Accepted()
        if job.state == "leased":
            duplicate = job.cancel_requested
            self._jobs[job.job_id] = msgspec.structs.replace(job, cancel_requested=True)
            return m.Accepted(duplicate=duplicate)
        if job.state == "cancelled":
            return m.Accepted(duplicate=True)
        return m.Refused(reason=f"job {job.job_id} already {job.state}" + (f" on {job.node}" if job.node else ""))

    def status(self) -> m.QueueStatus:
        held: dict[str, int] = {}
        for job in self._jobs.values():
            if job.state == "leased":
                held[job.node] = held.get(job.node, 0) + 1
        nodes = [msgspec.structs.replace(n, leases=held.get(n.node, 0)) for n in self._nodes.values()]
        jobs = [msgspec.structs.replace(j, lease_token="") if j.lease_token else j for j in self._jobs.values()]
        return m.QueueStatus(jobs=jobs, nodes=nodes, expired=self._expired, now=self._clock())

    # -- nodes ------------------------------------------------------------------------

    def lease(self, request: m.LeaseJobs) -> m.Leases:
        """Lease the first queued jobs that fit the offered slots, one job per slot."""
        now = self._clock()
        self._seen(request.node, request.summary, now)
        free = list(request.slots)
        leases = []
        for job in sorted(self._jobs.values(), key=lambda j: j.job_id):
            if not free:
                break
            if job.state != "queued" or job.spec.kind not in request.kinds:
                continue
            fitting = [s for s in free if fits(job.spec, s)]
            if not fitting:
                continue  # a smaller job behind it may fit
            free.remove(max(fitting, key=lambda s: s.bubble_share))
            leased = msgspec.structs.replace(
                job,
                state="leased",
                attempt=job.attempt + 1,
                node=request.node,
                lease_deadline=now + request.lease_s,
                lease_token=secrets.token_urlsafe(16),
            )
            self._jobs[job.job_id] = leased
            leases.append(
                m.Leased(
                    job_id=job.job_id,
                    attempt=leased.attempt,
                    spec=job.spec,
                    checkpointed_steps=job.checkpointed_steps,
                    token=leased.lease_token,
                    signature=job.signature,
                )
            )
        return m.Leases(leases=leases)

    def renew(self, request: m.RenewLeases) -> m.Renewed:
        """Extend the leases a node still holds, with its progress; name those it lost."""
        now = self._clock()
        self._seen(request.node, request.summary, now)
        lost, cancel = [], []
        for item in request.progress:
            job = self._holding(request.node, item.job_id, item.attempt, item.token)
            if job is None:
                lost.append(item.job_id)
                continue
            if job.cancel_requested:
                cancel.append(job.job_id)
            self._jobs[job.job_id] = msgspec.structs.replace(
                job,
                lease_deadline=now + request.lease_s,
                steps=item.steps,
                checkpointed_steps=max(job.checkpointed_steps, item.checkpointed_steps),
                metrics=item.metrics,
            )
        return m.Renewed(lost=lost, cancel=cancel)

    def finish(self, request: m.FinishJob) -> m.Accepted | m.Refused:
        job = self._jobs.get(request.job_id)
        if job is None:
            return m.Refused(reason=f"no job {request.job_id} in the queue")
        if job.state == "finished":
            if job.attempt == request.attempt and job.node == request.node:
                return m.Accepted(duplicate=True)
            return m.Refused(reason=f"job {job.job_id} was already finished by attempt {job.attempt} on {job.node}")
        held = self._holding(request.node, request.job_id, request.attempt, request.token)
        if held is None:
            return self._stale(job, request.node, request.attempt)
        self._end(held, "finished", "finished", request.steps, metrics=request.metrics)
        return m.Accepted()

    def fail(self, request: m.FailJob) -> m.Accepted | m.Refused:
        job = self._jobs.get(request.job_id)
        if job is None:
            return m.Refused(reason=f"no job {request.job_id} in the queue")
        if job.state == "failed" and job.attempt == request.attempt and job.node == request.node:
            return m.Accepted(duplicate=True)
        held = self._holding(request.node, request.job_id, request.attempt, request.token)
        if held is None:
            return self._stale(job, request.node, request.attempt)
        held = msgspec.structs.replace(held, failures=held.failures + 1, error=request.error)
        final = request.final or held.failures >= held.max_attempts or held.cancel_requested
        self._end(held, "failed" if final else "queued", "failed", request.steps, detail=request.error)
        return m.Accepted()

    def preempt(self, request: m.PreemptJob) -> m.Accepted | m.Refused:
        job = self._jobs.get(request.job_id)
        if job is None:
            return m.Refused(reason=f"no job {request.job_id} in the queue")
        held = self._holding(request.node, request.job_id, request.attempt, request.token)
        if held is None:
            last = job.history[-1] if job.history else None
            repeated = (
                last is not None
                and (last.attempt, last.node) == (request.attempt, request.node)
                and last.outcome in ("preempted", "cancelled")
            )
            if repeated and job.state in ("queued", "cancelled"):
                return m.Accepted(duplicate=True)
            return self._stale(job, request.node, request.attempt)
        held = msgspec.structs.replace(
            held, checkpointed_steps=max(held.checkpointed_steps, request.checkpointed_steps)
        )
        if held.cancel_requested:
            self._end(held, "cancelled", "cancelled", request.steps, detail="cancelled by a user")
        else:
            self._end(held, "queued", "preempted", request.steps, detail=request.reason)
        return m.Accepted()

    def expire(self) -> int:
        """Put every job whose lease ran out back in the queue; returns how many."""
        now = self._clock()
        count = 0
        for job in list(self._jobs.values()):
            if job.state == "leased" and job.lease_deadline < now:
                state: m.JobState = "cancelled" if job.cancel_requested else "queued"
                self._end(job, state, "expired", job.steps, detail=f"{job.node} stopped renewing its lease")
                count += 1
        self._expired += count
        return count

    # -- helpers ----------------------------------------------------------------------

    def jobs(self) -> Sequence[m.JobRecord]:
        return list(self._jobs.values())

    def _seen(self, node: str, summary: m.NodeSummary, now: float) -> None:
        self._nodes[node] = m.NodeRecord(node=node, last_seen=now, summary=summary)

    def _holding(self, node: str, job_id: int, attempt: int, token: str) -> m.JobRecord | None:
        job = self._jobs.get(job_id)
        if job is None or job.state != "leased" or job.node != node or job.attempt != attempt:
            return None
        if not hmac.compare_digest(job.lease_token.encode(), token.encode()):
            return None  # not the lease's holder (a forged report): as if it held no lease
        return job

    def _stale(self, job: m.JobRecord, node: str, attempt: int) -> m.Refused:
        now = f"attempt {job.attempt} is {job.state}" + (f" on {job.node}" if job.node else "")
        return m.Refused(reason=f"attempt {attempt} of job {job.job_id} on {node} holds no lease ({now})")

    def _end(
        self,
        job: m.JobRecord,
        state: m.JobState,
        outcome: m.Outcome,
        steps: int,
        *,
        detail: str = "",
        metrics: dict[str, float] | None = None,
    ) -> None:
        record = m.AttemptRecord(attempt=job.attempt, node=job.node, outcome=outcome, steps=steps, detail=detail)
        self._jobs[job.job_id] = msgspec.structs.replace(
            job,
            state=state,
            steps=steps,
            lease_deadline=0.0,
            lease_token="",
            metrics=job.metrics if metrics is None else metrics,
            history=[*job.history, record],
        )
