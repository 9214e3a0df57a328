"""The side-task API: estimates, running alone, stopping."""

from __future__ import annotations

from typing import Any

import pytest

from freeride.backends.predict import BubblePredictor
from freeride.sidetask import IterativeTask, StepEstimator, TaskStopped, UnboundedGate, run_alone


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


def test_estimator_uses_hint_then_slowest_recent_step() -> None:
    est = StepEstimator(hint_ns=5, window=3)
    assert est.estimate_ns == 5
    for d in (10, 30, 20):
        est.observe(d)
    assert est.estimate_ns == 30
    for d in (1, 1, 1):
        est.observe(d)
    assert est.estimate_ns == 1  # an outlier is forgotten after `window` steps


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


def test_predictor_prior_then_median_of_recent() -> None:
    pred = BubblePredictor(history=3)
    assert pred.expect("a") == -1
    pred.set_prior("a", 100)
    assert pred.expect("a") == 100
    for v in (10, 50, 20):
        pred.observe("a", v)
    assert pred.expect("a") == 20
    pred.observe("a", 60)  # window now 50, 20, 60
    assert pred.expect("a") == 50
