"""Running tools/train/deepspeed_gpt.py from tests, with or without FreeRide's hooks.

The training script is never edited: FreeRide attaches only through the
environment that ``freeride launch`` would set (:func:`launch_env`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _events import EventTap

from freeride import protocol as p
from freeride.backends.launch import ENV_MODE, ENV_PROFILE_DIR
from freeride.backends.session import ENV_EVENTS
from freeride.transport import BadFrame, new_async_context

__all__ = ["SCRIPT", "TrainRun", "plain_env", "run_alone", "run_training", "train_cmd"]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "train" / "deepspeed_gpt.py"
RUN_TIMEOUT_S = 300.0
"""Generous: the first DeepSpeed launch on a machine JIT-compiles a communication op."""


@dataclass
class TrainRun:
    returncode: int
    stdout: str
    stderr: str
    events: list[p.BackendEvent] = field(default_factory=list)
    other_work: float = 0.0
    """Other work's share of the cores during the run, where a test measured it (``_quiet``)."""

    @property
    def records(self) -> list[dict[str, Any]]:
        """The per-step JSON lines of every rank."""
        return [record for record in _json_lines(self.stdout) if "step" in record]

    def steps(self, rank: int) -> list[dict[str, Any]]:
        return sorted((r for r in self.records if r["rank"] == rank), key=lambda r: r["step"])

    def losses(self, rank: int) -> list[float]:
        return [float(r["loss"]) for r in self.steps(rank)]

    def median_step_ms(self, rank: int, *, skip: int = 2) -> float:
        return statistics.median(float(r["step_ms"]) for r in self.steps(rank)[skip:])

    def of(self, kind: type[Any], rank: int | None = None) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind) and (rank is None or e.rank == rank)]

    def explain(self) -> str:
        """The exit code, how far each rank got (its last step, whether it finished), and the output's tails."""
        got = {r["rank"]: r["step"] for r in self.records}
        done = sorted(r["rank"] for r in _json_lines(self.stdout) if r.get("done"))
        return (
            f"rc={self.returncode}; last step of each rank: {got}; finished: {done}\n"
            f"--- stdout (tail) ---\n{self.stdout[-1500:]}\n--- stderr (tail) ---\n{self.stderr[-4000:]}"
        )


def _json_lines(stdout: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def train_cmd(*args: str, ranks: int = 2) -> list[str]:
    """The training script's command; without DeepSpeed's shm all-reduce op, whose JIT build in a fresh
    install (1-2 minutes) tests nothing of FreeRide's."""
    return [sys.executable, str(SCRIPT), "--spawn", str(ranks), "--no-shm-op", *args]


def plain_env() -> dict[str, str]:
    """This process's environment without anything that would activate FreeRide."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV_EVENTS, ENV_MODE, ENV_PROFILE_DIR)}
    env.pop("PYTHONPATH", None)
    return env


async def run_training(
    cmd: list[str], *, env: Mapping[str, str], events: str | None = None, timeout_s: float = RUN_TIMEOUT_S
) -> TrainRun:
    """Run ``cmd`` to completion; with ``events``, also collect what arrives there."""
    receiver = None
    ctx = new_async_context()
    collected: list[p.BackendEvent] = []
    if events is not None:
        receiver = EventTap(ctx, events)

    async def pump() -> None:
        assert receiver is not None
        while True:
            event = await receiver.recv()
            if not isinstance(event, BadFrame):
                collected.append(event)

    proc = await asyncio.create_subprocess_exec(
        *cmd, env=dict(env), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT
    )
    try:
        async with asyncio.TaskGroup() as tg:
            pumping = tg.create_task(pump(), name="event-pump") if receiver is not None else None
            async with asyncio.timeout(timeout_s):
                out, err = await proc.communicate()
            if pumping is not None:
                # Goodbyes leave at interpreter exit; give the last frames a moment to land
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(5):
                        while len([e for e in collected if isinstance(e, p.Goodbye)]) < _ranks(cmd):
                            await asyncio.sleep(0.02)
                pumping.cancel()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if receiver is not None:
            receiver.close()
        ctx.term()
    return TrainRun(proc.returncode or 0, out.decode(), err.decode(), collected)


def _ranks(cmd: list[str]) -> int:
    return int(cmd[cmd.index("--spawn") + 1]) if "--spawn" in cmd else 1


def run_alone(cmd: list[str]) -> TrainRun:
    """The training ``cmd`` without FreeRide: the reference a test compares with.

    Run once more where a rank died in a C++ abort (``std::terminate`` inside
    torch's gloo, with no Python traceback: once in a CI run, in none of 60
    runs by hand, loaded or not). Nothing of FreeRide runs in it; a run under
    FreeRide is never repeated this way.
    """
    run = asyncio.run(run_training(cmd, env=plain_env()))
    if run.returncode != 0 and "terminate called" in run.stderr:
        print(f"the run without FreeRide aborted in C++; running it again. {run.explain()}", file=sys.stderr)
        run = asyncio.run(run_training(cmd, env=plain_env()))
    return run
