"""How many runs of what, and in which order: :class:`BenchOptions`, the flags that set it, and :func:`plan`."""

from __future__ import annotations

import argparse
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

# tools/bench is the script's directory: the harness's parts import by their bare names
from _bench_report import Role, RunKind
from _bench_tasks import SideTask, add_side_task_args, side_tasks

__all__ = [
    "SKIP_STEPS",
    "HOW_IT_RUNS",
    "SidePriority",
    "BenchOptions",
    "add_bench_args",
    "bench_parser",
    "parse_bench_args",
    "parse_schedules",
    "bench_options",
    "PlannedRun",
    "plan",
]

SKIP_STEPS = 3
"""Leading steps of every run left out of its medians."""

SidePriority = Literal["same", "low"]

HOW_IT_RUNS = """\
How the runs go (the same in every pipeline benchmark):

Before the runs, the job is profiled (by ``freeride profile``, or by itself for
the simulated job) and ``freeride serve --profile`` is started with the profile;
one iterative side task is submitted per stage, pinned to its stage's device (on
CPU: the stage's core, shared with the side task as a GPU would be).

A warm-up run of each kind comes first (per schedule, where there are several)
and is left out; then ``--pairs`` pairs (alone and with side tasks, the order
alternating) and ``--controls`` A/A pairs (alone and alone: the noise floor),
interleaved in time. Side tasks run at the stage's own priority
(``--side-priority same``: an overrun delays training as it would on a GPU)
unless ``--side-priority low`` is given.

Reports, as markdown: the training slowdown per pair (step time, and the
training ranks' CPU time per step) as a median with a distribution-free 95 %
interval of it (two order statistics; with too few pairs, the whole range and
what it covers), the A/A floor beside it and whether the interval lies below
the 0.5 % goal;
interference (side-task compute while the stage trained), the share of bubble
time the side tasks spent in steps (from ``freeride status``), their
throughput, grant latency and overruns. A pair whose side tasks finished,
failed or did no steps is named and left out.
"""
"""The ``--help`` epilog of every benchmark on this harness: what :func:`bench` does, said once."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchOptions:
    """How many runs of what, validated."""

    pairs: int = 8
    """Pairs of a run alone and a run with side tasks."""
    controls: int = 4
    """A/A control pairs (alone and alone)."""
    steps: int = 25
    """Training steps per run (the first :data:`SKIP_STEPS` are left out)."""
    hooked: bool = False
    """Also pairs of alone and the hooks with no manager listening (as many as ``controls``)."""
    side_priority: SidePriority = "same"
    """``same``: side tasks at the stage's priority (an overrun delays training, as on a GPU); ``low``: nice 19."""
    keep: bool = False
    """Keep the runtime directory (logs, profile)."""
    with_only: int = 0
    """Instead of pairs: this many runs with side tasks and nothing else (bubble use, interference and
    latency; no slowdown). 0: pairs as ``pairs`` and ``controls`` say."""
    holdback_every: int = 8
    """``serve --holdback-every``: one block of steps in this many gets no side work, so that the
    manager measures the job's cost on its own steps (its figure is reported beside the pairs')."""
    warm_alone: bool = True
    """Begin with a warm-up run alone (left out). Off where an earlier section has just run the same job on
    the same machine, so that its first run's costs (caches, the device's start) are paid already."""

    def __post_init__(self) -> None:
        if self.with_only < 0:
            raise ValueError(f"with_only must be >= 0, got {self.with_only}")
        if self.pairs < 1 and not self.with_only:
            raise ValueError(f"pairs must be >= 1, got {self.pairs}")
        if self.controls < 0:
            raise ValueError(f"controls must be >= 0, got {self.controls}")
        if self.steps <= SKIP_STEPS:
            raise ValueError(f"steps must be > {SKIP_STEPS}, got {self.steps}")
        if self.holdback_every < 0 or self.holdback_every % 2:
            raise ValueError(f"holdback_every must be 0 or an even number, got {self.holdback_every}")
        if self.side_priority not in ("same", "low"):
            raise ValueError(f"side_priority must be 'same' or 'low', got {self.side_priority!r}")


def add_bench_args(ap: argparse.ArgumentParser, *, steps: int = 25) -> None:
    """The flags of :class:`BenchOptions` (``steps``: this benchmark's default steps per run)."""
    ap.add_argument("--pairs", type=int, default=8, help="alone/with pairs, order alternating (default 8)")
    ap.add_argument("--controls", type=int, default=4, help="A/A pairs (alone/alone): the noise floor (default 4)")
    ap.add_argument("--steps", type=int, default=steps, help=f"training steps per run (default {steps})")
    ap.add_argument("--hooked", action="store_true", help="also pairs with the hooks but no manager listening")
    ap.add_argument(
        "--side-priority",
        choices=("same", "low"),
        default="same",
        help="side tasks at the stage's own CPU priority, so an overrun delays training as on a GPU "
        "(same, default), or at nice 19, the production default on CPU (low)",
    )
    ap.add_argument(
        "--keep",
        action="store_true",
        help="keep the runtime directory (logs, profile, and trace.json: every bubble and grant)",
    )
    ap.add_argument(
        "--holdback-every",
        type=int,
        default=8,
        metavar="BLOCKS",
        help="serve --holdback-every: one block of 4 steps in this many runs without side work, for the manager's"
        " own measure of the job's cost, reported beside the pairs' (default 8, serve's; 2 measures the most)",
    )
    ap.add_argument(
        "--with-only",
        type=int,
        default=0,
        metavar="N",
        help="only N runs with side tasks, no warm-up and no runs alone: bubble use, interference and latency "
        "(no slowdown figure); --pairs and --controls are then ignored",
    )


def bench_parser(description: str | None, *, steps: int) -> argparse.ArgumentParser:
    """A benchmark's parser: its own ``description``, :data:`HOW_IT_RUNS` below the flags, and the shared flags.

    The flags are those of :func:`add_bench_args` (``steps``: this benchmark's default) and
    :func:`add_side_task_args`; the benchmark adds its own.
    """
    ap = argparse.ArgumentParser(
        description=description, epilog=HOW_IT_RUNS, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_bench_args(ap, steps=steps)
    add_side_task_args(ap)
    return ap


def parse_bench_args(
    ap: argparse.ArgumentParser, argv: Sequence[str]
) -> tuple[argparse.Namespace, list[SideTask], BenchOptions]:
    """``argv`` parsed by ``ap`` (from :func:`bench_parser`), with the side tasks and options it names.

    A side task or option that :func:`side_tasks` or :class:`BenchOptions` refuses exits as a usage error,
    as argparse's own errors do.
    """
    ns = ap.parse_args(argv)
    try:
        return ns, side_tasks(ns), bench_options(ns)
    except ValueError as exc:
        ap.error(str(exc))


def parse_schedules(ap: argparse.ArgumentParser, names: str, known: Collection[str]) -> tuple[str, ...]:
    """The comma-separated ``--schedules`` ``names``, each one of ``known``; anything else exits as a usage error."""
    schedules = tuple(s.strip() for s in names.split(",") if s.strip())
    if not schedules or set(schedules) - set(known):
        ap.error(f"schedules must be among {sorted(known)}, got {schedules}")
    return schedules


def bench_options(ns: argparse.Namespace) -> BenchOptions:
    """:class:`BenchOptions` from the flags of :func:`add_bench_args`.

    Raises:
        ValueError: a value out of range.
    """
    return BenchOptions(
        pairs=ns.pairs,
        controls=ns.controls,
        steps=ns.steps,
        hooked=ns.hooked,
        side_priority=ns.side_priority,
        keep=ns.keep,
        with_only=ns.with_only,
        holdback_every=ns.holdback_every,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class PlannedRun:
    """One run of the plan: what it runs, and where it stands among the pairs."""

    kind: RunKind
    role: Role
    """``warmup`` (left out), or the ``a`` (alone) or ``b`` side of a pair."""
    pair: int
    """Index of the pair; -1 for a warm-up run."""
    pair_kind: RunKind
    """What the pair compares with alone: ``with``, ``hooked``, or ``alone`` (an A/A control)."""


def plan(options: BenchOptions) -> list[PlannedRun]:
    """The runs in time order: warm-ups, then the pairs, controls spread evenly among them, ABBA order.

    With ``with_only``: just that many runs with side tasks (the side tasks rehearse their steps before
    training starts, so no warm-up run is needed for them; none is left out).
    """
    if options.with_only:
        return [PlannedRun(kind="with", role="b", pair=i, pair_kind="with") for i in range(options.with_only)]
    runs = [PlannedRun(kind="alone", role="warmup", pair=-1, pair_kind="alone")] if options.warm_alone else []
    if options.hooked:
        runs.append(PlannedRun(kind="hooked", role="warmup", pair=-1, pair_kind="hooked"))
    runs.append(PlannedRun(kind="with", role="warmup", pair=-1, pair_kind="with"))
    groups: list[tuple[RunKind, int]] = [("with", options.pairs), ("alone", options.controls)]
    if options.hooked:
        groups.append(("hooked", options.controls))
    # each pair sits at the middle of its share of the sequence; ties keep the group order
    slots = sorted(
        ((i + 0.5) / count, g, kind) for g, (kind, count) in enumerate(groups) for i in range(count) if count
    )
    for index, (_, _, kind) in enumerate(slots):
        a = PlannedRun(kind="alone", role="a", pair=index, pair_kind=kind)
        b = PlannedRun(kind=kind, role="b", pair=index, pair_kind=kind)
        runs += [a, b] if index % 2 == 0 else [b, a]
    return runs
