"""A side task that tells where it runs (imported by worker processes via PYTHONPATH)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from _tasks import SpinSteps

from freeride.sidetask import TaskContext

__all__ = ["WhereAmI"]


class WhereAmI(SpinSteps):
    """:class:`_tasks.SpinSteps` that appends, at each setup, its device, cores, threads and restored step count."""

    def __init__(self, *, where: str, step_ms: float = 2.0) -> None:
        super().__init__(step_ms=step_ms)
        self.where = where

    async def setup(self, ctx: TaskContext) -> None:
        await super().setup(ctx)
        torch = sys.modules.get("torch")
        line = {
            "device": ctx.device,
            "pid": os.getpid(),
            "restored": self.count,
            "cores": sorted(os.sched_getaffinity(0)),
            "threads": torch.get_num_threads() if torch is not None else -1,
            "omp": os.environ.get("OMP_NUM_THREADS", ""),
        }
        self._write(line)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)  # after setup: the restored count amends the setup's line
        self._write({"pid": os.getpid(), "restored": self.count})

    def _write(self, line: dict[str, Any]) -> None:
        with open(self.where, "a") as f:
            f.write(json.dumps(line) + "\n")
