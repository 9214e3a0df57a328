"""A side task with two step kinds, for the estimates tests (imported by worker processes via PYTHONPATH)."""

from __future__ import annotations

import time
from typing import Any

from freeride.sidetask import IterativeTask, TaskContext

__all__ = ["TellsItsBubble", "TwoKinds"]


class TwoKinds(IterativeTask):
    """Alternates steps of kind ``a`` (``step_ms``) and ``b`` (twice as long); no step-time hint."""

    warm_up = False  # what is measured is the store alone: no rehearsal before training

    def __init__(self, *, step_ms: float = 1.0) -> None:
        self.step_ns = int(step_ms * 1e6)
        self.count = 0

    def step_kind(self) -> str:
        return "a" if self.count % 2 == 0 else "b"

    def step(self) -> None:
        end = time.monotonic_ns() + self.step_ns * (1 if self.count % 2 == 0 else 2)
        while time.monotonic_ns() < end:
            pass
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = int(state["count"])


class TellsItsBubble(IterativeTask):
    """Writes the typical bubble it was told at setup to ``told.txt`` in its workdir, and names its kind by it."""

    warm_up = False

    def __init__(self) -> None:
        self.bubble_ns = -1

    async def setup(self, ctx: TaskContext) -> None:
        self.bubble_ns = ctx.bubble_ns
        (ctx.workdir / "told.txt").write_text(str(ctx.bubble_ns))

    def step_kind(self) -> str:
        return f"bubble{self.bubble_ns}"

    def step(self) -> None:
        time.sleep(1e-4)
