"""The cluster queue's accounting (freeride.cluster.ledger), on a fake clock: no Ray, no processes."""

from __future__ import annotations

import msgspec
import pytest

from freeride import protocol as p
from freeride.cluster import ledger as ledger_module
from freeride.cluster import messages as m
from freeride.cluster.ledger import Ledger, fits


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _spec(name: str, peak: int = -1) -> p.TaskSpec:
    return p.IterativeSpec(target="freeride.sidetasks.sweep:SweepShard", name=name, peak_memory=peak)


def _slots(n: int, spare: int = -1) -> list[m.Slot]:
    return [m.Slot(device=f"cpu:{i}", spare_memory=spare, bubble_share=0.3) for i in range(n)]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ledger(clock: FakeClock) -> Ledger:
    ledger = Ledger(clock)
    reply = ledger.handle(m.SubmitJobs(specs=[_spec(f"job-{i}") for i in range(3)], max_attempts=2))
    assert reply == m.Submitted(job_ids=[1, 2, 3])
    return ledger


def _lease(ledger: Ledger, node: str, n: int, lease_s: float = 10.0) -> list[m.Leased]:
    reply = ledger.handle(m.LeaseJobs(node=node, slots=_slots(n), lease_s=lease_s))
    assert isinstance(reply, m.Leases)
    return reply.leases


def _job(ledger: Ledger, job_id: int) -> m.JobRecord:
    return next(j for j in ledger.jobs() if j.job_id == job_id)


def test_jobs_are_leased_in_order_one_per_slot_and_never_twice(ledger: Ledger) -> None:
    a = _lease(ledger, "a", 2)
    b = _lease(ledger, "b", 2)
    assert [(x.job_id, x.attempt) for x in a] == [(1, 1), (2, 1)]
    assert [(x.job_id, x.attempt) for x in b] == [(3, 1)]
    assert _lease(ledger, "c", 4) == []


def test_only_jobs_that_fit_the_spare_memory_are_leased(clock: FakeClock) -> None:
    ledger = Ledger(clock)
    ledger.handle(m.SubmitJobs(specs=[_spec("big", peak=8 << 30), _spec("small", peak=1 << 30)]))
    reply = ledger.handle(m.LeaseJobs(node="a", slots=_slots(2, spare=2 << 30), lease_s=10))
    assert isinstance(reply, m.Leases)
    assert [x.spec.name for x in reply.leases] == ["small"]  # the big one waits for a node with room
    assert fits(_spec("big", peak=8 << 30), m.Slot(device="cuda:0", spare_memory=16 << 30))
    gpu_only = msgspec.structs.replace(_spec("g"), device_kind="gpu")
    assert not fits(gpu_only, m.Slot(device="cpu:0")) and fits(gpu_only, m.Slot(device="cuda:1"))


def test_a_lease_not_renewed_expires_and_the_job_resumes_from_its_checkpoint_elsewhere(
    ledger: Ledger, clock: FakeClock
) -> None:
    (lease,) = _lease(ledger, "a", 1, lease_s=5)
    progress = m.JobProgress(job_id=1, attempt=1, state="running", steps=40, checkpointed_steps=30, token=lease.token)
    assert ledger.handle(m.RenewLeases(node="a", progress=[progress], lease_s=5)) == m.Renewed()
    clock.now += 4  # renewed at 100: still held at 104
    assert _job(ledger, 1).state == "leased"
    clock.now += 2  # 106 > 105: node a stopped renewing
    (again,) = _lease(ledger, "b", 1)
    assert (again.job_id, again.attempt, again.checkpointed_steps) == (1, 2, 30)
    job = _job(ledger, 1)
    assert [(h.attempt, h.node, h.outcome, h.steps) for h in job.history] == [(1, "a", "expired", 40)]
    assert job.failures == 0  # a dead node is not the job's fault
    status = ledger.handle(m.QueueStatusRequest())
    assert isinstance(status, m.QueueStatus) and status.expired == 1


def test_a_node_that_comes_back_late_learns_its_lease_is_lost_and_cannot_finish(
    ledger: Ledger, clock: FakeClock
) -> None:
    (first,) = _lease(ledger, "a", 1, lease_s=5)
    clock.now += 6
    (second,) = _lease(ledger, "b", 1)  # job 1, attempt 2
    late = m.JobProgress(job_id=1, attempt=1, state="running", steps=50, token=first.token)
    assert ledger.handle(m.RenewLeases(node="a", progress=[late], lease_s=5)) == m.Renewed(lost=[1])
    refused = ledger.handle(m.FinishJob(node="a", job_id=1, attempt=1, steps=100, token=first.token))
    assert isinstance(refused, m.Refused) and "holds no lease" in refused.reason
    assert ledger.handle(m.FinishJob(node="b", job_id=1, attempt=2, steps=100, token=second.token)) == m.Accepted()
    assert _job(ledger, 1).state == "finished"


def test_a_finish_is_counted_once(ledger: Ledger) -> None:
    (lease,) = _lease(ledger, "a", 1)
    finish = m.FinishJob(node="a", job_id=1, attempt=1, steps=100, metrics={"x": 1.0}, token=lease.token)
    assert ledger.handle(finish) == m.Accepted()
    assert ledger.handle(finish) == m.Accepted(duplicate=True)  # the same report again: nothing changes
    other = ledger.handle(m.FinishJob(node="b", job_id=1, attempt=2, steps=100))
    assert isinstance(other, m.Refused) and "already finished by attempt 1 on a" in other.reason
    job = _job(ledger, 1)
    assert [h.outcome for h in job.history] == ["finished"] and job.metrics == {"x": 1.0}
    gone = ledger.handle(m.FinishJob(node="a", job_id=99, attempt=1))
    assert isinstance(gone, m.Refused) and "no job 99" in gone.reason


def test_failures_count_against_max_attempts_and_preemptions_do_not(ledger: Ledger) -> None:
    (first,) = _lease(ledger, "a", 1)
    preempt = m.PreemptJob(node="a", job_id=1, attempt=1, reason="left", checkpointed_steps=7, token=first.token)
    assert ledger.handle(preempt) == m.Accepted()
    assert ledger.handle(preempt) == m.Accepted(duplicate=True)
    (second,) = _lease(ledger, "b", 1)
    assert (second.attempt, second.checkpointed_steps) == (2, 7)
    assert ledger.handle(m.FailJob(node="b", job_id=1, attempt=2, error="boom", token=second.token)) == m.Accepted()
    assert _job(ledger, 1).state == "queued"  # one failure of two allowed: tried again
    (third,) = _lease(ledger, "c", 1)
    assert third.attempt == 3
    again = m.FailJob(node="c", job_id=1, attempt=3, error="boom again", token=third.token)
    assert ledger.handle(again) == m.Accepted()
    job = _job(ledger, 1)
    assert (job.state, job.failures, job.error) == ("failed", 2, "boom again")
    assert [h.outcome for h in job.history] == ["preempted", "failed", "failed"]
    assert ledger.handle(again) == m.Accepted(duplicate=True)
    assert [x.job_id for x in _lease(ledger, "d", 3)] == [2, 3]  # a failed job is never leased again


def test_bad_submissions_are_refused_with_the_reason(ledger: Ledger) -> None:
    taken = ledger.handle(m.SubmitJobs(specs=[_spec("job-1"), _spec("new"), _spec("new")]))
    assert isinstance(taken, m.Refused) and "job-1, new" in taken.reason
    unnamed = ledger.handle(m.SubmitJobs(specs=[_spec("")]))
    assert isinstance(unnamed, m.Refused) and "needs a name" in unnamed.reason
    assert isinstance(ledger.handle(m.SubmitJobs(specs=[])), m.Refused)
    assert isinstance(ledger.handle(m.SubmitJobs(specs=[_spec("x")], max_attempts=0)), m.Refused)
    assert len(ledger.jobs()) == 3  # nothing of a refused submission stays


def test_requests_round_trip_the_wire() -> None:
    request = m.LeaseJobs(node="a", slots=_slots(2, spare=1 << 30), lease_s=5, summary=m.NodeSummary(devices=2))
    assert m.decode_request(m.encode(request)) == request
    with pytest.raises(msgspec.ValidationError):
        m.decode_request(m.encode(m.LeaseJobs(node="", slots=[], lease_s=1)))


def test_status_and_report_show_every_node_and_each_attempt_once(ledger: Ledger, clock: FakeClock) -> None:
    from freeride.cluster.view import cluster_report, format_cluster_status, format_report

    summary = m.NodeSummary(devices=2, alive_devices=2, bubble_ns=4_000_000_000, used_ns=3_000_000_000,
                            train_ns=8_000_000_000, interference_ns=40_000_000)  # fmt: skip
    on_a = ledger.handle(m.LeaseJobs(node="a", slots=_slots(2), lease_s=5, summary=summary))
    ledger.handle(m.LeaseJobs(node="b", slots=_slots(1), lease_s=5, summary=summary))
    assert isinstance(on_a, m.Leases)
    one, two = on_a.leases
    ledger.handle(m.FinishJob(node="a", job_id=1, attempt=1, steps=10, token=one.token))
    clock.now += 2
    progress = m.JobProgress(job_id=2, attempt=1, state="running", token=two.token)
    ledger.handle(m.RenewLeases(node="a", progress=[progress], lease_s=5, summary=summary))
    clock.now += 4  # b's lease ran out
    status = ledger.handle(m.QueueStatusRequest())
    assert isinstance(status, m.QueueStatus)
    text = format_cluster_status(status)
    assert "jobs: 3 (queued 1, leased 1, finished 1, failed 0, cancelled 0); leases expired: 1" in text
    assert "\na                    4.0s      1   2/2          4.00 s   75.0%          0.5%\n" in text
    assert "\n    3 job-2                    queued          1    0/2 -  " in text
    assert "waiting for a node that offers room; attempt 1 expired on b: b stopped renewing its lease" in text
    assert "lease held, renewed by a; expires in 1s" in text
    assert all(job.lease_token == "" for job in status.jobs)  # the holders' secrets are never shown
    report = cluster_report(status)
    assert report["total"]["bubble_ns"] == 8_000_000_000 and report["total"]["harvested_share"] == 0.75
    assert report["attempts"] == {"finished": 1, "failed": 0, "preempted": 0, "expired": 1, "cancelled": 0}
    assert report["nodes"]["a"]["attempts"] == 1 and report["nodes"]["b"]["attempts"] == 1
    assert "cluster" in format_report(report) and "steps of finished jobs: 10" in format_report(report)


def test_only_the_lease_holder_can_renew_it_or_say_how_it_ended(ledger: Ledger) -> None:
    """Another Ray driver that knows the node's name and the attempt, but not the lease's token, is refused."""
    (lease,) = _lease(ledger, "a", 1)
    for forged in (
        m.FinishJob(node="a", job_id=1, attempt=1, steps=10),
        m.FailJob(node="a", job_id=1, attempt=1, error="x"),
        m.PreemptJob(node="a", job_id=1, attempt=1, reason="x"),
        m.FinishJob(node="a", job_id=1, attempt=1, token=lease.token[:-1] + "x"),
    ):
        refused = ledger.handle(forged)
        assert isinstance(refused, m.Refused) and "holds no lease" in refused.reason, forged
    renewal = m.RenewLeases(node="a", progress=[m.JobProgress(job_id=1, attempt=1, state="running")], lease_s=5)
    assert ledger.handle(renewal) == m.Renewed(lost=[1])
    assert _job(ledger, 1).state == "leased"  # nothing forged changed it
    assert ledger.handle(m.FinishJob(node="a", job_id=1, attempt=1, token=lease.token)) == m.Accepted()


def test_a_node_leases_programs_only_when_it_allows_them(clock: FakeClock) -> None:
    ledger = Ledger(clock)
    program = p.ProgramSpec(argv=["id"], name="prog")
    ledger.handle(m.SubmitJobs(specs=[program, _spec("task")]))
    plain = ledger.handle(m.LeaseJobs(node="a", slots=_slots(2), lease_s=5))
    assert isinstance(plain, m.Leases) and [x.spec.name for x in plain.leases] == ["task"]
    allowing = ledger.handle(m.LeaseJobs(node="b", slots=_slots(2), lease_s=5, kinds=["iterative", "imperative"]))
    assert isinstance(allowing, m.Leases) and [x.spec.name for x in allowing.leases] == ["prog"]


def test_cancel_ends_a_queued_job_at_once_and_a_leased_one_through_its_node(ledger: Ledger, clock: FakeClock) -> None:
    (lease,) = _lease(ledger, "a", 1)  # job 1 leased; jobs 2 and 3 queued
    assert ledger.handle(m.CancelJob(job_id=2)) == m.Accepted()
    assert _job(ledger, 2).state == "cancelled"
    assert ledger.handle(m.CancelJob(job_id=2)) == m.Accepted(duplicate=True)
    assert [x.job_id for x in _lease(ledger, "b", 3)] == [3]  # a cancelled job is never leased
    assert ledger.handle(m.CancelJob(job_id=1)) == m.Accepted()
    progress = m.JobProgress(job_id=1, attempt=1, state="running", steps=5, token=lease.token)
    assert ledger.handle(m.RenewLeases(node="a", progress=[progress], lease_s=5)) == m.Renewed(cancel=[1])
    # its node stops it (it checkpoints) and gives it back: it ends cancelled, not queued
    back = m.PreemptJob(node="a", job_id=1, attempt=1, reason="cancelled on a", steps=7, token=lease.token)
    assert ledger.handle(back) == m.Accepted()
    job = _job(ledger, 1)
    assert job.state == "cancelled" and [h.outcome for h in job.history] == ["cancelled"]
    assert ledger.handle(back) == m.Accepted(duplicate=True)
    done = ledger.handle(m.CancelJob(job_id=99))
    assert isinstance(done, m.Refused) and "no job 99" in done.reason


def test_a_node_whose_manager_rejects_the_spec_fails_the_job_at_once(ledger: Ledger) -> None:
    (lease,) = _lease(ledger, "a", 1)
    rejected = m.FailJob(node="a", job_id=1, attempt=1, error="a rejected it: bad", final=True, token=lease.token)
    assert ledger.handle(rejected) == m.Accepted()
    assert _job(ledger, 1).state == "failed"  # max_attempts is 2, but no other node would do better


def test_one_submission_queues_at_most_max_submit_jobs() -> None:
    too_many = m.SubmitJobs(specs=[_spec(f"j{i}") for i in range(m.MAX_SUBMIT + 1)])
    with pytest.raises(msgspec.ValidationError):
        m.decode_request(m.encode(too_many))


def test_the_queue_holds_at_most_max_jobs_whatever_the_submissions(
    clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # MAX_SUBMIT bounds one submission; the queue's own bound holds across submissions
    monkeypatch.setattr(ledger_module, "MAX_JOBS", 5)
    queue = Ledger(clock)
    assert isinstance(queue.handle(m.SubmitJobs(specs=[_spec(f"a{i}") for i in range(3)])), m.Submitted)
    refused = queue.handle(m.SubmitJobs(specs=[_spec(f"b{i}") for i in range(3)]))
    assert isinstance(refused, m.Refused) and "at most 5 jobs; 3 are in it" in refused.reason
    assert len(queue.jobs()) == 3, "nothing of the refused submission was queued"
    assert isinstance(queue.handle(m.SubmitJobs(specs=[_spec(f"c{i}") for i in range(2)])), m.Submitted)


def test_a_name_given_twice_in_the_largest_submission_is_refused(clock: FakeClock) -> None:
    names = [f"j{i}" for i in range(m.MAX_SUBMIT - 1)] + ["j7"]
    reply = Ledger(clock).handle(m.SubmitJobs(specs=[_spec(n) for n in names]))
    assert isinstance(reply, m.Refused) and "given twice: j7" in reply.reason
