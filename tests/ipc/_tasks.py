"""Side tasks used by the ipc tests (imported by worker processes via PYTHONPATH)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from freeride.sidetask import IterativeTask, TaskContext

__all__ = ["CrashOnce", "Hog", "SpinSteps"]


class SpinSteps(IterativeTask):
    """Each step burns ``step_ms`` of CPU and records when it ran."""

    step_time = -1.0
    warm_up = False  # its log of step intervals is what tests read: no rehearsal outside bubbles

    def __init__(self, *, step_ms: float = 2.0, max_steps: int = 0, log: str = "", cpu_trace_ms: float = 0.0) -> None:
        self.step_ns = int(step_ms * 1e6)
        self.max_steps = max_steps
        self.count = 0
        self.log = log
        self.intervals: list[tuple[int, int]] = []
        self.cpu: list[int] = []
        """CPU time of each step, as the process's CPU clock measured it."""
        self.trace_ns = int(cpu_trace_ms * 1e6)
        self.traces: list[list[tuple[int, int]]] = []
        """With ``cpu_trace_ms``: per step, (monotonic, process CPU) readings that far apart, and its first and last."""

    async def setup(self, ctx: TaskContext) -> None:
        self.ctx = ctx

    def step(self) -> None:
        c0 = time.process_time_ns()
        t0 = time.monotonic_ns()
        end = t0 + self.step_ns
        trace = [(t0, c0)] if self.trace_ns else []
        next_reading = t0 + self.trace_ns
        while (now := time.monotonic_ns()) < end:
            if trace and now >= next_reading:
                trace.append((now, time.process_time_ns()))
                next_reading = now + self.trace_ns
        self.count += 1
        t1, c1 = time.monotonic_ns(), time.process_time_ns()
        self.intervals.append((t0, t1))
        self.cpu.append(c1 - c0)
        if trace:
            self.traces.append([*trace, (t1, c1)])
        if self.log and len(self.intervals) % 50 == 0:
            self._flush()

    def _flush(self) -> None:
        tmp = self.log + ".tmp"
        Path(tmp).write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "count": self.count,
                    "intervals": self.intervals,
                    "cpu": self.cpu,
                    "traces": self.traces,
                }
            )
        )
        os.replace(tmp, self.log)

    def done(self) -> bool:
        return bool(self.max_steps) and self.count >= self.max_steps

    def metrics(self) -> dict[str, float]:
        return {"count": float(self.count)}

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])

    async def teardown(self) -> None:
        if self.log:
            self._flush()


class CrashOnce(SpinSteps):
    """Crashes the worker process (hard exit) at step ``crash_at`` unless a marker file exists."""

    def __init__(self, *, crash_at: int = 20, marker: str = "", **kw: Any) -> None:
        super().__init__(**kw)
        self.crash_at = crash_at
        self.marker = marker

    def step(self) -> None:
        super().step()
        if self.count == self.crash_at and self.marker and not Path(self.marker).exists():
            Path(self.marker).write_text("crashed")
            os._exit(17)


class Hog(IterativeTask):
    """Allocates ``mb`` MiB in its first step: more than it declared."""

    step_time = 0.001

    def __init__(self, *, mb: int = 800) -> None:
        self.mb = mb
        self.kept: list[bytearray] = []

    def step(self) -> None:
        self.kept.append(bytearray(self.mb << 20))
