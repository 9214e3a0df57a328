"""The side-task API: estimates, running alone, stopping."""

from __future__ import annotations

from typing import Any

import pytest

from freeride.backends.predict import BubblePredictor
from freeride.sidetask import IterativeTask, StepEstimates, StepEstimator, TaskStopped, UnboundedGate, run_alone


class Counter(IterativeTask):
    def __init__(self, *, limit: int = 0) -> None:
        self.n, self.limit = 0, limit
        self.torn_down = False

    def step(self) -> None:
        self.n += 1

    def done(self) -> bool:
        return bool(self.limit) and self.n >= self.limit

    async def teardown(self) -> None:
        self.torn_down = True


class AsyncCounter(Counter):
    async def step(self) -> None:  # type: ignore[override]
        self.n += 2


def test_estimator_uses_hint_then_a_high_percentile_of_recent_steps() -> None:
    est = StepEstimator(hint_ns=5, window=10)
    assert est.estimate_ns == 5
    est.observe(10)
    assert est.estimate_ns == 10
    for d in (20, 30, 40, 50, 60, 70, 80, 90, 100):
        est.observe(d)
    assert est.estimate_ns == 90  # p90 of 10..100


def test_estimator_ignores_a_single_outlier_but_not_a_slowdown() -> None:
    est = StepEstimator(window=16)
    for d in [1000] * 10 + [50_000]:
        est.observe(d)
    assert est.estimate_ns == 1000
    for _ in range(3):
        est.observe(5000)
    assert est.estimate_ns == 5000  # a lasting slowdown shows
    for _ in range(16):
        est.observe(1000)
    assert est.estimate_ns == 1000


def test_each_step_kind_has_its_own_estimate() -> None:
    est = StepEstimates(hint_ns=7)
    assert est.estimate_ns() == 7 and est.estimate_ns("update") == -1  # the hint is the default kind's
    for _ in range(5):
        est.observe("micro", 1000)
        est.observe("update", 30_000)
    assert est.estimate_ns("micro") == 1000  # not held back by the slow kind
    assert est.estimate_ns("update") == 30_000
    assert est.estimate_ns() == 7
    assert sorted(est.kinds()) == ["", "micro", "update"]


def test_estimator_unknown_without_hint() -> None:
    assert StepEstimator().estimate_ns == -1
    with pytest.raises(ValueError, match="window"):
        StepEstimator(window=0)


async def test_run_alone_stops_after_the_steps_asked() -> None:
    task = Counter()
    durations = await run_alone(task, steps=7)
    assert task.n == 7 and len(durations) == 7 and task.torn_down


async def test_run_alone_ends_when_the_task_is_done() -> None:
    task = Counter(limit=3)
    assert len(await run_alone(task, steps=100)) == 3


async def test_async_steps_are_awaited() -> None:
    task = AsyncCounter()
    await run_alone(task, steps=4)
    assert task.n == 8


async def test_task_stopped_escapes_except_exception() -> None:
    class Swallower(Counter):
        async def run(self, gate: Any) -> None:
            try:
                await super().run(gate)
            except Exception:  # a user's broad handler must not eat the stop
                pytest.fail("TaskStopped was caught as an Exception")

    gate = UnboundedGate(max_steps=2)
    with pytest.raises(TaskStopped):
        await Swallower().run(gate)


def test_predictor_min_policy_takes_the_shortest_recent_wait() -> None:
    pred = BubblePredictor(history=3, policy="min")
    pred.set_prior("a", 100)
    for v in (10, 50, 20):
        pred.observe("a", v)
    assert pred.expect("a") == 10
    pred.observe("a", 60)  # window now 50, 20, 60
    assert pred.expect("a") == 20


def test_predictor_errs_low_by_default_but_leaves_one_short_outlier_out() -> None:
    pred = BubblePredictor()
    pred.set_prior("a", 100)
    assert pred.expect("a") == 100
    for v in (20, 21, 5):  # three seen: the shortest
        pred.observe("a", v)
    assert pred.expect("a") == 5
    pred.observe("a", 22)  # four: the one early wake-up no longer sets the prediction
    assert pred.expect("a") == 20
    pred.observe("a", 6)  # a second short one in the last eight counts
    assert pred.expect("a") == 6
    for v in (21, 20, 22, 21, 20, 22, 21):  # then both age out of the last eight
        pred.observe("a", v)
    assert pred.expect("a") == 20


def test_predictor_prior_then_median_of_recent() -> None:
    pred = BubblePredictor(history=3, policy="median")
    assert pred.expect("a") == -1
    pred.set_prior("a", 100)
    assert pred.expect("a") == 100
    for v in (10, 50, 20):
        pred.observe("a", v)
    assert pred.expect("a") == 20
    pred.observe("a", 60)  # window now 50, 20, 60
    assert pred.expect("a") == 50
