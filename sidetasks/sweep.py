"""One shard of a sweep: a small, exactly checkable job for the cluster queue.

Shard ``i`` of ``shards`` sums ``x * x`` over its slice of ``range(shards * size)``,
``chunk`` numbers per step, and checkpoints where it is. When the last step
is done it writes ``OUT/shard-I.json`` (the sum, the step its run resumed from,
the host and process) and appends one line to ``OUT/shard-I.log``: a shard
that ran to its end twice shows two lines there, and a resumed shard whose
state was lost shows a wrong sum.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from freeride.sidetask import IterativeTask

__all__ = ["SweepShard", "expected_sum"]


def expected_sum(shard: int, size: int) -> int:
    """The sum shard ``shard`` must find: ``x * x`` over ``range(shard * size, (shard + 1) * size)``."""

    def squares_below(n: int) -> int:
        return (n - 1) * n * (2 * n - 1) // 6

    return squares_below((shard + 1) * size) - squares_below(shard * size)


class SweepShard(IterativeTask):
    """Sum of squares over one shard of a range; writes its result file once done.

    Options: ``shard`` and ``shards`` (``freeride cluster submit --shards N`` sets them), ``size`` (numbers
    per shard), ``chunk`` (numbers per step), ``out`` (an absolute directory for the result; none: no file).

    Metrics: ``progress`` (the share of the shard done).
    """

    step_time = 0.001
    peak_memory = 0
    warm_up = False  # its last step writes files: never rehearse it

    def __init__(
        self, *, shard: int = 0, shards: int = 1, size: int = 1_000_000, chunk: int = 10_000, out: str = ""
    ) -> None:
        if not 0 <= shard < shards:
            raise ValueError(f"shard must be in 0..{shards - 1}, got {shard}")
        if size < 1 or chunk < 1:
            raise ValueError(f"size and chunk must be >= 1, got size={size} chunk={chunk}")
        if out and not os.path.isabs(out):
            raise ValueError(f"out must be an absolute directory (the task runs in its own workdir), got {out!r}")
        self.shard, self.size, self.chunk, self.out = shard, size, chunk, out
        self.start = shard * size
        self.position = 0
        self.total = 0
        self.resumed_from = 0

    def step(self) -> None:
        a = self.start + self.position
        b = min(self.start + self.size, a + self.chunk)
        self.total += sum(x * x for x in range(a, b))
        self.position = b - self.start
        if self.done() and self.out:
            self._write_result()

    def done(self) -> bool:
        return self.position >= self.size

    def metrics(self) -> dict[str, float]:
        return {"progress": self.position / self.size}

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "total": str(self.total)}  # the sum outgrows an int64

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position, self.total = int(state["position"]), int(state["total"])
        self.resumed_from = self.position

    def _write_result(self) -> None:
        out = Path(self.out)
        out.mkdir(parents=True, exist_ok=True)
        result = {
            "shard": self.shard,
            "sum": str(self.total),
            "resumed_from": self.resumed_from,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        tmp = out / f".shard-{self.shard}.json.tmp"
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out / f"shard-{self.shard}.json")
        with open(out / f"shard-{self.shard}.log", "a") as log:
            log.write(json.dumps(result) + "\n")
