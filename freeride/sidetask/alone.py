"""A task run alone, without a manager: a gate that never parks, to profile and test tasks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TypeVar

from freeride.sidetask.task import IterativeTask, TaskContext, TaskStopped

__all__ = ["UnboundedGate", "run_alone"]

_T = TypeVar("_T")


class UnboundedGate:
    """A gate that never parks: runs a task alone and measures its steps.

    Used to profile a task (step time, peak memory) before it is placed, and to
    test tasks without a manager.
    """

    def __init__(self, *, max_steps: int | None = None) -> None:
        self.max_steps = max_steps
        self.durations_ns: list[int] = []
        self.kinds: list[str] = []
        """The kind of each measured step, in order."""

        self.reported: dict[str, float] = {}
        """The metrics last published with :meth:`report`."""

    @property
    def steps(self) -> int:
        return len(self.durations_ns)

    def remaining(self) -> float | None:
        return None  # no grant: nothing bounds a step

    def report(self, **metrics: float) -> None:
        self.reported.update(metrics)

    async def wait_for(self, awaitable: Awaitable[_T]) -> _T:
        return await awaitable

    async def idle_until(self, source: AsyncIterable[_T]) -> AsyncIterator[_T]:
        async for item in source:
            yield item

    @asynccontextmanager
    async def step(self, kind: str = "") -> AsyncIterator[None]:
        if self.max_steps is not None and self.steps >= self.max_steps:
            raise TaskStopped(f"ran {self.max_steps} steps")
        t0 = time.monotonic_ns()
        yield
        self.durations_ns.append(time.monotonic_ns() - t0)
        self.kinds.append(kind)


async def run_alone(
    task: IterativeTask, *, steps: int, ctx: TaskContext | None = None, gate: UnboundedGate | None = None
) -> list[int]:
    """Set up ``task`` and run at most ``steps`` steps back to back.

    Pass ``gate`` to read more than the durations afterwards (the kind of each step).

    Returns:
        The measured duration of each step in nanoseconds.
    """
    if ctx is None:
        ctx = TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=Path.cwd())
    if gate is None:
        gate = UnboundedGate()
    gate.max_steps = steps
    await task.setup(ctx)
    try:
        await task.run(gate)
    except TaskStopped:
        pass
    finally:
        await task.teardown()
    return gate.durations_ns
