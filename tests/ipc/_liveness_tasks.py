"""Side tasks for the liveness tests (imported by worker processes via PYTHONPATH)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from _tasks import SpinSteps

from freeride.sidetask import IterativeTask, TaskContext

__all__ = ["AlwaysHang", "BigState", "CrashInSetup", "HangOnce", "LateTorch", "SlowCheckpoint", "SlowOnce"]


class HangOnce(SpinSteps):
    """Hangs in step ``hang_at`` (writing ``marker`` first) unless ``marker`` exists: a step that never ends.

    With ``armed``, only in a step from ``hang_at`` on once that file exists: the test creates it
    when the manager has recorded a checkpoint of some progress, what a restart from a checkpoint
    needs, on a machine of any speed. (The task cannot tell a save from its own ``state_dict``
    calls: the worker also reads it to size the state, and a save may then wait for a bubble
    with room.)
    """

    def __init__(self, *, hang_at: int = 20, marker: str = "", armed: str = "", **kw: Any) -> None:
        super().__init__(**kw)
        self.hang_at, self.marker, self.armed = hang_at, marker, armed

    def step(self) -> None:
        super().step()
        if self.count < self.hang_at or not self.marker or Path(self.marker).exists():
            return
        if self.armed and not Path(self.armed).exists():
            return
        Path(self.marker).write_text(str(os.getpid()))
        time.sleep(3600)


class SlowOnce(SpinSteps):
    """Step ``slow_at`` computes for ``slow_s`` of CPU time, far longer than any bubble; then writes
    ``marker`` with the step's wall and CPU seconds (a step frozen between bubbles takes longer by wall)."""

    def __init__(self, *, slow_at: int = 20, slow_s: float = 2.0, marker: str = "", **kw: Any) -> None:
        super().__init__(**kw)
        self.slow_at, self.slow_s, self.marker = slow_at, slow_s, marker

    def step(self) -> None:
        super().step()
        if self.count != self.slow_at or Path(self.marker).exists():
            return
        t0, c0 = time.monotonic(), time.process_time()
        while time.process_time() - c0 < self.slow_s:
            pass
        Path(self.marker).write_text(f"{time.monotonic() - t0} {time.process_time() - c0}")


class AlwaysHang(SpinSteps):
    """Hangs in step ``hang_at`` after every start: a restart from its checkpoint cannot help."""

    def __init__(self, *, hang_at: int = 5, **kw: Any) -> None:
        super().__init__(**kw)
        self.hang_at = hang_at
        self.since_start = 0

    def step(self) -> None:
        super().step()
        self.since_start += 1
        if self.since_start >= self.hang_at:
            time.sleep(3600)


class SlowCheckpoint(SpinSteps):
    """Saving takes ``save_ms``, longer than any bubble; the count after each step goes to ``count_file``."""

    def __init__(self, *, save_ms: float = 300.0, count_file: str = "", restored_file: str = "", **kw: Any) -> None:
        super().__init__(**kw)
        self.save_s = save_ms / 1e3
        self.count_file, self.restored_file = count_file, restored_file

    def step(self) -> None:
        super().step()
        if self.count_file:
            tmp = self.count_file + ".tmp"
            Path(tmp).write_text(str(self.count))
            os.replace(tmp, self.count_file)

    def state_dict(self) -> dict[str, Any]:
        time.sleep(self.save_s)
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.restored_file:
            Path(self.restored_file).write_text(str(self.count))


class BigState(SpinSteps):
    """A state of ``state_mb`` MB (a model with its optimizer's buffers); each step writes its count at both ends.

    Restored from a checkpoint, it writes ``"<count> <consistent> <restoring>"`` to ``restored_file``:
    consistent when both ends hold the count it came back with (the state of one step, not a mix);
    restoring as its setup was told (a checkpoint follows).
    """

    def __init__(self, *, state_mb: int = 500, restored_file: str = "", **kw: Any) -> None:
        super().__init__(**kw)
        import torch

        self.w = torch.full((state_mb * 2**20 // 4,), 0.5)
        self.restored_file = restored_file

    def step(self) -> None:
        super().step()
        self.w[0] = self.w[-1] = float(self.count)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "w": self.w}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
        self.w.copy_(state["w"])
        consistent = float(self.w[0]) == float(self.w[-1]) == float(self.count)
        if self.restored_file:
            Path(self.restored_file).write_text(f"{self.count} {consistent} {self.ctx.restoring}")


class CrashInSetup(IterativeTask):
    """Dies at once, every time: what restart backoff is for."""

    async def setup(self, ctx: TaskContext) -> None:
        os._exit(3)

    def step(self) -> None:
        pass


class LateTorch(IterativeTask):
    """Imports torch only in its first step, after the manager's memory cap is in place, then finishes."""

    step_time = 0.001
    warm_up = False  # its first step, under the cap, is what the test watches

    def __init__(self, *, steps: int = 3) -> None:
        self.steps, self.count = steps, 0
        self.total = 0.0

    def step(self) -> None:
        import torch

        self.total += float(torch.ones(1000).sum())
        self.count += 1

    def done(self) -> bool:
        return self.count >= self.steps

    def metrics(self) -> dict[str, float]:
        return {"total": self.total}

    def state_dict(self) -> dict[str, Any]:  # a state: the worker's checkpoints import torch too
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])
