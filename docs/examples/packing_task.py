"""Packing: a task that splits its next step to fit what is left of a bubble.

Each step sums the squares of a chunk of numbers. A whole chunk is one step
kind; when it does not fit in the room left, the task offers half a chunk,
then a quarter, ... each its own step kind with its own time estimate.

Alone:      python docs/examples/packing_task.py
As filler:  freeride submit docs/examples/packing_task.py:SumOfSquares --fill
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from freeride import IterativeTask
from freeride.sidetask import run_alone


class SumOfSquares(IterativeTask):
    step_time = 0.001

    def __init__(self, *, n: int = 10_000_000, chunk: int = 4096, min_piece: int = 256) -> None:
        self.n, self.chunk, self.min_piece = n, chunk, min_piece
        self.next = self.total = 0  # the first number not yet summed, and the sum so far
        self.piece = chunk  # how many numbers the next step sums

    def done(self) -> bool:
        return self.next >= self.n

    def step_kind(self) -> str:
        return self.kind_of(self.piece)

    def kind_of(self, piece: int) -> str:
        return "" if piece == self.chunk else f"piece{piece}"

    def fit_piece(self, room_ns: int, estimate_ns: Callable[[str], int]) -> str | None:
        whole = estimate_ns("")  # the step_time hint until a whole chunk has been measured
        piece = self.chunk
        while piece >= self.min_piece:
            need = estimate_ns(self.kind_of(piece))
            if need < 0:  # this piece not measured yet: in proportion to the whole chunk
                need = whole * piece // self.chunk
            if need <= room_ns:
                self.piece = piece
                return self.kind_of(piece)
            piece //= 2
        return None  # nothing fits: the pending step waits for a longer bubble

    def step(self) -> None:
        end = min(self.next + self.piece, self.n)
        self.total += sum(i * i for i in range(self.next, end))
        self.next = end

    def metrics(self) -> dict[str, float]:
        return {"done": self.next / self.n}

    def state_dict(self) -> dict[str, Any]:
        return {"next": self.next, "total": self.total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next, self.total = int(state["next"]), int(state["total"])


async def main() -> None:
    task = SumOfSquares(n=100_000)
    await run_alone(task, steps=1_000)
    assert task.total == sum(i * i for i in range(task.n))
    print(f"sum of squares below {task.n}: {task.total}")


if __name__ == "__main__":
    asyncio.run(main())
