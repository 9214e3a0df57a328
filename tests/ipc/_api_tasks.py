"""Side tasks for the side-task API tests (imported by worker processes via PYTHONPATH)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

from freeride.sidetask import IterativeTask, StepGate, TaskContext

__all__ = ["FailsInSetup", "SpoolConsumer"]


class SpoolConsumer(IterativeTask):
    """Processes the files that appear in ``spool``, one per step, waiting for the next between steps.

    Built the usual PyTorch way: its state (the set of files done) exists only after ``setup``,
    so a checkpoint can be loaded only after it. Each file processed appends a line to ``log``.
    """

    step_time = 0.001

    def __init__(self, *, spool: str, log: str) -> None:
        self.spool, self.log = Path(spool), Path(log)

    async def setup(self, ctx: TaskContext) -> None:
        self.processed: set[str] = set()
        self.queue: asyncio.Queue[str] = asyncio.Queue()

    async def _produce(self) -> None:
        """Feeds the queue with new files of the spool directory (the task's own I/O)."""
        queued: set[str] = set()
        while True:
            for name in sorted(os.listdir(self.spool)):
                # a dot-file is one being written (renamed into place when complete): not an item yet
                if not name.startswith(".") and name not in self.processed and name not in queued:
                    queued.add(name)
                    self.queue.put_nowait(name)
            await asyncio.sleep(0.01)

    async def run(self, gate: StepGate) -> None:
        producer = asyncio.create_task(self._produce(), name="spool-producer")
        try:
            while True:
                name = await gate.wait_for(self.queue.get())
                async with gate.step():
                    with self.log.open("a") as f:
                        f.write(f"{name}\n")
                    self.processed.add(name)
                gate.report(done=float(len(self.processed)))
        finally:
            producer.cancel()

    def step(self) -> None:  # run() does the work
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"done": sorted(self.processed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.processed.update(state["done"])  # fails if setup has not run


class FailsInSetup(IterativeTask):
    """A task whose setup raises: it can never run."""

    def __init__(self, *, size: int = 1) -> None:
        self.size = size

    async def setup(self, ctx: TaskContext) -> None:
        raise RuntimeError(f"cannot build a model of size {self.size}")

    def step(self) -> None:
        pass
