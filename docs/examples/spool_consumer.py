"""An async task: it processes the files dropped into a spool directory, as they come.

Between files it waits through the gate, so it holds no bubble while it waits,
answers a cancel at once (with a checkpoint) and keeps its status fresh.

Alone:      python docs/examples/spool_consumer.py
In bubbles: freeride submit docs/examples/spool_consumer.py:SpoolConsumer --opt spool=/data/in --opt out=/data/out
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from freeride import IterativeTask, StepGate, TaskContext
from freeride.sidetask import run_alone


class SpoolConsumer(IterativeTask):
    step_time = 0.001
    warm_up = False  # a step writes a file: a rehearsal would leave it behind

    def __init__(self, *, spool: str, out: str, poll_s: float = 0.05) -> None:
        self.spool, self.out, self.poll_s = Path(spool), Path(out), poll_s
        self.done_names: set[str] = set()

    async def arrivals(self) -> AsyncIterator[Path]:
        """The spool's new files, oldest name first; waits for more when none is left."""
        while True:
            for path in sorted(self.spool.iterdir()):
                if path.name not in self.done_names and not path.name.startswith("."):
                    yield path
            await asyncio.sleep(self.poll_s)

    async def run(self, gate: StepGate) -> None:
        async for path in gate.idle_until(self.arrivals()):
            async with gate.step():
                text = path.read_text()
                (self.out / path.name).write_text(text.upper())
                self.done_names.add(path.name)
            left = gate.remaining()  # seconds left in this grant, None outside one
            gate.report(done=len(self.done_names), room_ms=1e3 * left if left is not None else -1.0)

    def step(self) -> None:  # run() does the work
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"done": sorted(self.done_names)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done_names = set(state["done"])


async def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spool, out = Path(tmp, "in"), Path(tmp, "out")
        spool.mkdir()
        out.mkdir()
        for i in range(5):
            (spool / f"{i}.txt").write_text(f"item {i}")
        task = SpoolConsumer(spool=str(spool), out=str(out))
        ctx = TaskContext(task_id=0, device="cpu:0", torch_device="cpu", workdir=out)
        await run_alone(task, steps=4, ctx=ctx)  # stops as the fifth step starts
        print(sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    asyncio.run(main())
