"""What a benchmark runs: the training job, and the side tasks it submits as the flags name them."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from freeride.tasks.targets import resolve
from freeride.units import parse_duration_ns

__all__ = ["ROOT", "TASK_DEFAULTS", "Job", "SideTask", "add_side_task_args", "side_task", "side_tasks"]

ROOT = Path(__file__).resolve().parents[2]
"""This checkout: where job scripts are shown relative to, and the code every process of a benchmark imports."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    title: str
    """Heading of the markdown section."""
    script: Path
    args: tuple[str, ...]
    """Arguments of the training script (besides ``--spawn`` and ``--steps``)."""
    profiles_itself: bool = False
    """The script writes its own bubble profile with ``--profile-out FILE`` (the simulated job);
    otherwise the harness runs it under ``freeride profile``."""

    def cmd(self, steps: int) -> list[str]:
        return [sys.executable, str(self.script), "--spawn", "2", "--steps", str(steps), *self.args]

    def shown(self, steps: int) -> str:
        return shlex.join(["python", str(self.script.relative_to(ROOT)), *self.cmd(steps)[2:]])


@dataclass(frozen=True, kw_only=True, slots=True)
class SideTask:
    target: str
    """``module:Class``."""
    options: tuple[str, ...]
    step_time: str
    """Expected step time until measured."""
    fill: bool = False
    """Submitted as a filler of the ends of bubbles (``freeride submit --fill``)."""


TASK_DEFAULTS: dict[str, tuple[str, ...]] = {
    # the default batch steps far longer than a small job's bubbles
    "freeride.sidetasks.graph_sgd:GraphSGD": ("batch_edges=2048",),
}
"""Options a benchmark gives a side task (``module:Class``) unless ``--opt`` sets them; other tasks get none."""


def add_side_task_args(ap: argparse.ArgumentParser) -> None:
    """The ``--task``, ``--opt`` and ``--step-time`` flags the benchmarks take (see :func:`side_task`)."""
    ap.add_argument("--task", default="graph-sgd", help="a side task from `freeride submit --list`, or module:Class")
    ap.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="side-task option (repeatable); graph-sgd defaults to batch_edges=2048",
    )
    ap.add_argument("--step-time", default="2ms", help="the side task's expected step time, until measured")
    ap.add_argument(
        "--fill",
        metavar="TASK",
        default="",
        help="a second side task per device that fills the ends of bubbles the first leaves (a mix)",
    )
    ap.add_argument(
        "--fill-opt", action="append", default=[], metavar="KEY=VALUE", help="option of the --fill task (repeatable)"
    )
    ap.add_argument("--fill-step-time", default="1ms", help="the --fill task's expected step time, until measured")


def side_tasks(ns: argparse.Namespace) -> list[SideTask]:
    """The side tasks :func:`add_side_task_args`' flags name: the task, and its filler if ``--fill`` is given.

    Raises:
        ValueError: as :func:`side_task`.
    """
    tasks = [side_task(ns.task, ns.opt, ns.step_time)]
    if ns.fill:
        fill = side_task(ns.fill, ns.fill_opt, ns.fill_step_time)
        tasks.append(SideTask(target=fill.target, options=fill.options, step_time=fill.step_time, fill=True))
    elif ns.fill_opt:
        raise ValueError("--fill-opt without --fill")
    return tasks


def side_task(task: str, opts: Sequence[str], step_time: str) -> SideTask:
    """The side task to submit: ``task``'s defaults from :data:`TASK_DEFAULTS`, overridden key by key by ``opts``.

    Raises:
        ValueError: ``task`` is no side task name, an option is not ``KEY=VALUE`` or ``step_time`` no duration.
    """
    parse_duration_ns(step_time)
    target = resolve(task)
    options: dict[str, str] = {}
    for pair in (*TASK_DEFAULTS.get(target, ()), *opts):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--opt expects KEY=VALUE, got {pair!r}")
        options[key.replace("-", "_")] = value  # as `freeride submit` spells the key
    return SideTask(target=target, options=tuple(f"{k}={v}" for k, v in options.items()), step_time=step_time)
