"""What a run measured: its step figures from the job's JSON lines, and what the manager counted during it."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass

# tools/bench is the script's directory: the harness's parts import by their bare names
from _bench_options import SKIP_STEPS
from _bench_report import RunResult

from freeride import protocol as p
from freeride.holdback import HoldbackSchedule

__all__ = ["StepFigures", "holdback_of", "parse_steps", "with_figures"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepFigures:
    """What a run's JSON lines say."""

    step_ms: float
    """Rank 0's median step time (after :data:`SKIP_STEPS`)."""
    cpu_ms: float | None
    """Sum over ranks of each rank's median CPU time per step; None if the job does not report it."""
    trained_ns: int
    """Sum over ranks of all their step times: how long the stages trained."""
    held_step_ms: float | None = None
    """Rank 0's median over the measured steps held back from side work (None: none, or no schedule given)."""


def parse_steps(stdout: str, holdback: HoldbackSchedule | None = None) -> StepFigures:
    """The figures of a run from its JSON lines (one per rank and step, with ``step_ms`` and maybe ``cpu_ms``).

    With the manager's ``holdback`` schedule of the run's job, also the median of rank 0's steps
    that it held back from side work and measures (its ``step``, else the line's place in order).

    Raises:
        RuntimeError: rank 0 printed no more than :data:`SKIP_STEPS` steps.
    """
    steps: dict[int, list[float]] = {}
    cpu: dict[int, list[float]] = {}
    held: list[float] = []
    for line in stdout.splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if "step_ms" not in record:
            continue
        rank = int(record["rank"])
        mine = steps.setdefault(rank, [])
        step = int(record.get("step", len(mine)))
        mine.append(float(record["step_ms"]))
        slot = holdback.slot(step) if holdback is not None and rank == 0 and step >= SKIP_STEPS else None
        if slot is not None and slot.role == "held" and slot.measured:
            held.append(float(record["step_ms"]))
        if "cpu_ms" in record:
            cpu.setdefault(rank, []).append(float(record["cpu_ms"]))
    times = steps.get(0, [])
    if len(times) <= SKIP_STEPS:
        raise RuntimeError(f"training printed {len(times)} steps of rank 0")
    cpu_ms = None
    if cpu and all(len(v) > SKIP_STEPS for v in cpu.values()):
        cpu_ms = sum(statistics.median(v[SKIP_STEPS:]) for v in cpu.values())
    trained_ns = round(sum(sum(v) for v in steps.values()) * 1e6)
    return StepFigures(
        step_ms=statistics.median(times[SKIP_STEPS:]),
        cpu_ms=cpu_ms,
        trained_ns=trained_ns,
        held_step_ms=statistics.median(held) if held else None,
    )


def with_figures(result: RunResult, before: p.StatusReply, after: p.StatusReply) -> None:
    """Fill ``result`` with what the manager counted between ``before`` and ``after``, and its flags."""
    old = {d.device: d for d in before.devices}
    for d in after.devices:
        o = old.get(d.device)
        result.bubble_ns += d.bubble_ns - (o.bubble_ns if o else 0)
        result.offered_ns += d.offered_ns - (o.offered_ns if o else 0)
        result.used_ns += d.used_ns - (o.used_ns if o else 0)
        result.overruns += d.overruns - (o.overruns if o else 0)
        result.overrun_ns += d.overrun_ns - (o.overrun_ns if o else 0)
        result.interference_ns += d.interference_ns - (o.interference_ns if o else 0)
        result.train_ns += d.train_ns - (o.train_ns if o else 0)
    old_steps = {t.task_id: t.steps for t in before.tasks}
    for t in after.tasks:
        done = t.steps - old_steps.get(t.task_id, 0)
        name = f"{t.name}@{t.device or '?'}"
        result.task_steps[name] = done
        if t.state in p.TERMINAL_STATES:
            why = f": {t.error}" if t.error else ""
            result.flags.append(f"{name} {t.state} after {done} steps in this run{why}")
        elif done == 0:
            result.flags.append(f"{name} did no steps in this run")
    if not after.tasks:
        result.flags.append("no side tasks")


def holdback_of(job: str, every: int) -> HoldbackSchedule | None:
    """The held-back steps ``serve --holdback-every every`` gives the job named ``job`` (None: none)."""
    if not every:
        return None
    return HoldbackSchedule(p.Holdback(job=job, every=every, max_every=4 * every))
