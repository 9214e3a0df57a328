"""A side task's lifecycle: every state change goes through one transition table."""

from __future__ import annotations

from pathlib import Path

import pytest

from freeride import protocol as p
from freeride.cli.status import _liveness_shown
from freeride.serve.tasks import BadTransition, TaskRecord


def record(kind: p.TaskKind = "iterative", max_restarts: int = 2) -> TaskRecord:
    spec: p.TaskSpec = (
        p.IterativeSpec(target="m:C", max_restarts=max_restarts)
        if kind == "iterative"
        else p.ProgramSpec(argv=["prog"], max_restarts=max_restarts)
    )
    return TaskRecord(task_id=1, spec=spec, name="t", checkpoint_path=Path("/x"))


def test_placed_ready_finished() -> None:
    t = record()
    t.place("cpu:0")
    assert (t.state, t.device, t.runnable, t.active) == ("starting", "cpu:0", False, True)
    t.ready(estimate_ns=5, steps=3)
    assert (t.state, t.runnable, t.estimate_ns, t.steps) == ("running", True, 5, 3)
    t.finish()
    assert t.state == "finished" and not t.runnable and t.terminal and t.done.is_set()
    assert t.exited(0) is False and t.state == "finished"  # the worker's exit after its report


def test_a_crash_restarts_until_the_restarts_are_spent() -> None:
    t = record(max_restarts=2)
    t.place("cpu:0")
    t.ready()
    assert t.exited(1) is True and t.state == "starting" and t.restarts == 1
    assert (t.error, t.restart_reason) == ("", "worker exited with code 1")  # a reason, not the running task's error
    assert t.exited(-9) is True and t.restarts == 2  # crashed again while setting up
    assert t.restart_reason == "worker exited with code -9"  # this exit's, not the first's
    assert t.exited(1) is False and t.state == "failed" and t.done.is_set()
    assert t.error == "worker exited with code 1"


def test_a_restart_counts_the_steps_it_goes_back_over_and_shows_no_old_error() -> None:
    """The worker resumes from its checkpoint: what was done after it is lost and done again."""
    t = record()
    t.place("cpu:0")
    t.ready(steps=0)
    t.steps = 150  # its progress; the last checkpoint was at step 100
    t.error = "RuntimeError: out of memory"  # what its worker reported before it died
    assert t.exited(1) is True
    t.ready(steps=100)
    status = t.status()
    assert (status.steps, status.lost_steps, status.error) == (100, 50, "")
    assert status.restart_reason == "RuntimeError: out of memory"
    assert "restarts 1 (the last after 0s: RuntimeError: out of memory; 50 steps done again)" in _liveness_shown(status)


def test_a_requested_stop_ends_cancelled_whatever_the_exit_code() -> None:
    t = record()
    t.place("cpu:0")
    t.ready()
    t.request_stop()
    assert not t.runnable
    assert t.exited(-15) is False and t.state == "cancelled"


def test_an_imperative_program_that_exits_0_has_finished() -> None:
    t = record("imperative")
    t.place("cpu:0")
    t.ready()
    assert t.exited(0) is False and t.state == "finished"


def test_a_pending_task_can_be_cancelled_but_not_made_ready() -> None:
    t = record()
    with pytest.raises(BadTransition, match="pending -> running"):
        t.ready()
    t.cancel()
    assert t.state == "cancelled"


@pytest.mark.parametrize("end", sorted(p.TERMINAL_STATES))
def test_no_state_is_left_once_terminal(end: p.TaskState) -> None:
    t = record()
    t.place("cpu:0")
    {"finished": t.finish, "cancelled": t.cancel, "failed": lambda: t.fail("x")}[end]()
    for move in (lambda: t.place("cpu:1"), t.ready, t.finish, t.cancel, lambda: t.fail("y")):
        with pytest.raises(BadTransition):
            move()
    assert t.state == end


def test_a_report_accounts_steps_busy_time_and_the_next_estimate() -> None:
    t = record()
    t.place("cpu:0")
    t.ready(estimate_ns=10)
    base = {"grant_id": 1, "first_step_delay_ns": 1, "overrun_ns": 0, "reason": "no_fit"}
    t.account(p.GrantDone(task_id=1, steps=2, busy_ns=30, step_estimate_ns=12, **base))
    assert (t.steps, t.busy_ns, t.estimate_ns) == (2, 30, 12)
    # a worker that counts its own steps is believed over the sum (a Progress may overtake a report)
    t.account(p.GrantDone(task_id=1, steps=1, busy_ns=5, step_estimate_ns=12, total_steps=9, **base))
    assert (t.steps, t.busy_ns) == (9, 35)
