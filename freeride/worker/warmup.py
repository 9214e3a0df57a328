"""Warm-up: a task's first steps of each kind, run before training starts, then undone.

A step kind's first run in a fresh process is slow (kernel selection and
allocation, an optimizer's buffers created at its first update; ResNet-50's
pieces on CPU: 0.6 s more in all than their usual time, up to 90 ms for one
piece), and a kind not measured yet can only be tried at the start of a
bubble. Both cost bubbles, and both overrun them. When no training runs on
the task's device yet, the worker therefore runs the task's steps back to back
until each kind has been seen :data:`RUNS_PER_KIND` times (or a time or step
limit is reached), then restores the state from before: the steps are
rehearsal, not progress. What the runs after each kind's first took seeds the
gate's estimates (:meth:`WarmUp.seed`), so no bubble is spent measuring.

Only tasks with a checkpointable state are warmed up (restoring it is what
undoes the steps), and a task can opt out (``warm_up = False`` on its class,
e.g. one whose steps write outputs elsewhere).
"""

from __future__ import annotations

import copy
import inspect
import logging
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TypeVar

from freeride.sidetask import IterativeTask, StepEstimates, TaskStopped, UnboundedGate
from freeride.worker.gate import RunDelay, ThreadRunDelay

__all__ = ["RUNS_PER_KIND", "WarmUp", "warm_up"]

_T = TypeVar("_T")

logger = logging.getLogger(__name__)

RUNS_PER_KIND = 3
"""Runs of each kind: the first pays the one-time costs; the rest are measured."""


class WarmUp(UnboundedGate):
    """A gate that runs steps back to back until every kind seen has run :data:`RUNS_PER_KIND` times.

    A rehearsal ends where the task would wait for its own input: nothing is
    waited for before training starts.

    Args:
        max_steps: Steps at most.
        max_ns: Time at most (checked between steps).
        run_delay: This thread's CPU wait counter: time a step waited for a core (training
            runs beside it) is taken out of what it measured, as the gate does.
    """

    def __init__(self, *, max_steps: int, max_ns: int, run_delay: RunDelay | None = None) -> None:
        super().__init__(max_steps=max_steps)
        self.max_ns = max_ns
        self._run_delay: RunDelay = ThreadRunDelay() if run_delay is None else run_delay
        self.seen: dict[str, int] = {}
        self.measured: list[tuple[str, int]] = []
        """(kind, duration) of each step after its kind's first."""
        self._t0 = time.monotonic_ns()

    def _enough(self) -> bool:
        if (self.max_steps is not None and self.steps >= self.max_steps) or (
            time.monotonic_ns() - self._t0 >= self.max_ns
        ):
            return True
        return bool(self.seen) and all(n >= RUNS_PER_KIND for n in self.seen.values())

    def seed(self, estimates: StepEstimates) -> None:
        """Give ``estimates`` every measured run, in order: the gate starts from them.

        The estimator weighs them as it weighs the steps it measures itself (a
        high percentile that one outlier does not set); seeding only the slowest
        run of each kind let one outlier set the estimate (D42).
        """
        for kind, took in self.measured:
            estimates.observe(kind, took, rehearsal=True)

    def close(self) -> None:
        """Release the CPU wait counter."""
        self._run_delay.close()

    async def wait_for(self, awaitable: Awaitable[_T]) -> _T:
        if inspect.iscoroutine(awaitable):
            awaitable.close()  # never awaited: no "coroutine was never awaited" warning
        raise TaskStopped("the rehearsal ends where the task waits for its input")

    async def idle_until(self, source: AsyncIterable[_T]) -> AsyncIterator[_T]:
        raise TaskStopped("the rehearsal ends where the task waits for its input")
        yield  # an async generator, as the gate's  # pragma: no cover

    @asynccontextmanager
    async def step(self, kind: str = "") -> AsyncIterator[None]:
        if self._enough():
            raise TaskStopped("rehearsed")
        delay0 = self._run_delay.ns()
        t0 = time.monotonic_ns()
        yield
        took = max(1, time.monotonic_ns() - t0 - (self._run_delay.ns() - delay0))
        self.durations_ns.append(took)
        self.kinds.append(kind)
        runs = self.seen.get(kind, 0)
        self.seen[kind] = runs + 1
        if runs:
            self.measured.append((kind, took))


async def warm_up(task: IterativeTask, *, max_steps: int = 5000, max_s: float = 5.0) -> WarmUp | None:
    """Run ``task``'s steps outside any bubble, then restore its state; ``None`` if it cannot be undone.

    The task must be set up (and restored from its checkpoint, if any). The time
    bound is the one that counts: a partitioned VGG-19 has ~300 pieces a batch,
    which 500 steps left mostly unmeasured.

    Returns:
        The warm-up's record (each measured step's kind and duration), or
        ``None`` where the task opts out or has no state to restore.
    """
    if not getattr(type(task), "warm_up", True):
        return None
    state = task.state_dict()
    if not state:
        return None
    saved = copy.deepcopy(state)  # the steps below change the live tensors in place
    gate = WarmUp(max_steps=max_steps, max_ns=int(max_s * 1e9))
    try:
        await task.run(gate)
    except TaskStopped:
        pass
    finally:
        gate.close()
        task.load_state_dict(saved)
    logger.info(
        "[worker] warmed up: %d steps of %d kinds, %d measured, restored",
        gate.steps,
        len(gate.seen),
        len(gate.measured),
    )
    return gate
