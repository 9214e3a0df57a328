"""``freeride plan``: its options, the files it reads, and how it prints a plan.

The job's shape comes from the command line or from a ``freeride profile``
file; the side-task mix from ``--task`` (with the measured use of
:mod:`freeride.planning.measured`, or ``--use`` for a share measured elsewhere,
e.g. by ``freeride report``), step times from ``freeride profile-task``
estimates files; the model and the formula from :mod:`freeride.planning.model`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from freeride.backends.schedule import SCHEDULE_NAMES
from freeride.observe.report import Prices, parse_throughputs
from freeride.planning.measured import DEMO, MEASURED, MeasuredUse, measured_for
from freeride.planning.model import SCALE_GPUS, JobShape, Plan, PlanOptions, ScaleRow, TaskShare, make_plan
from freeride.profile import StageProfile, load_profile
from freeride.tasks.estimates import read_estimates_file
from freeride.units import format_ns, parse_duration_ns, parse_share

__all__ = ["add_plan_parser", "cmd_plan", "plan_dict", "plan_text", "shape_from_args", "tasks_from_args"]


def add_plan_parser(subs: Any) -> None:
    """Register ``freeride plan`` on ``subs`` (the parser's sub-commands)."""
    s = subs.add_parser(
        "plan",
        help="estimate harvested GPU-hours, cost saving and interference of a job, and at 1K-16K GPUs",
        description="Model a pipeline job's bubbles (from its shape or a `freeride profile` file) and what a"
        " side-task mix harvests of them, by measured bubble use; every assumption is printed.",
    )
    job = s.add_argument_group("the job (or --profile)")
    job.add_argument("--profile", metavar="FILE", help="a profile written by `freeride profile`")
    job.add_argument("--gpus", type=int, help="GPUs of the job (default: pp x tp x dp, or the profile's devices)")
    job.add_argument("--pp", type=int, help="pipeline stages p")
    job.add_argument("--tp", type=int, default=1, help="GPUs per stage (tensor parallel; default 1)")
    job.add_argument("--micro-batches", type=int, help="micro-batches per pipeline per step m")
    job.add_argument("--global-batch", type=int, help="samples per step, fixed at every size (m = B / (b x dp))")
    job.add_argument("--micro-batch-size", type=int, help="samples per micro-batch b")
    job.add_argument("--chunks", type=int, default=1, help="model chunks per stage v (interleaved)")
    job.add_argument("--schedule", choices=SCHEDULE_NAMES, default="1f1b")
    job.add_argument("--step-time", metavar="TIME", help="measured step time, e.g. 12s")
    job.add_argument("--forward", metavar="TIME[,TIME...]", help="forward per micro-batch, one value or one per stage")
    job.add_argument("--backward", metavar="TIME[,TIME...]", help="backward per micro-batch, likewise")
    job.add_argument(
        "--p2p-latency",
        metavar="TIME",
        help="latency of a hand-over between stages (default 0; with --profile, measured from the profile)",
    )
    job.add_argument(
        "--ratio", default="1:2", metavar="F:B", help="forward:backward when only --step-time is given (default 1:2)"
    )
    mix = s.add_argument_group("the side-task mix")
    mix.add_argument(
        "--task",
        action="append",
        default=[],
        metavar="NAME[=SHARE]",
        help="a side task and its share of the bubbles (repeatable; shares not given split the rest equally)",
    )
    mix.add_argument(
        "--use",
        action="append",
        default=[],
        metavar="NAME=SHARE",
        help="bubble use of a task measured elsewhere (e.g. harvested share of `freeride report`), or NAME=demo",
    )
    mix.add_argument(
        "--interference", action="append", default=[], metavar="NAME=SHARE", help="its measured interference"
    )
    mix.add_argument(
        "--estimates",
        action="append",
        default=[],
        metavar="FILE",
        help="a step-time estimates file of `freeride profile-task` (STATE_DIR/estimates/*.json)",
    )
    mix.add_argument("--task-step", action="append", default=[], metavar="NAME=TIME", help="a task's step time")
    mix.add_argument(
        "--side-throughput",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME=STEPS_PER_S",
        help="steps/s of a task alone on the cheap GPU (as `freeride report`)",
    )
    price = s.add_argument_group("prices (as `freeride report`)")
    price.add_argument("--train-gpu-price", type=float, default=3.96, help="$ per hour of one training GPU")
    price.add_argument("--side-gpu-price", type=float, default=0.18, help="$ per hour of the cheap GPU")
    s.add_argument(
        "--scale",
        default=",".join(map(str, SCALE_GPUS)),
        metavar="N[,N...]",
        help="GPU counts of the scale table (default 1K-16K)",
    )
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_plan)


def _times(text: str, stages: int, what: str) -> tuple[float, ...]:
    values = tuple(parse_duration_ns(t) / 1e9 for t in text.split(","))
    if len(values) == 1:
        return values * stages
    if len(values) != stages:
        raise ValueError(f"--{what}: {len(values)} values for {stages} stages (give one, or one per stage)")
    return values


def shape_from_args(args: argparse.Namespace) -> JobShape:
    """The job's shape from the options, or from ``--profile`` (options given override it).

    Raises:
        ValueError: Missing or inconsistent options, or an unreadable profile.
    """
    step = parse_duration_ns(args.step_time) / 1e9 if args.step_time else None
    comm = parse_duration_ns(args.p2p_latency) / 1e9 if args.p2p_latency else None
    if args.profile:
        profile = load_profile(Path(args.profile))
        if not profile.stages:
            raise ValueError(f"{args.profile}: the profile has no stages")
        by_stage = {s.stage: s for s in profile.stages}  # one device per stage is enough for the shape
        pp = profile.stages[0].num_stages
        if sorted(by_stage) != list(range(pp)):
            raise ValueError(f"{args.profile}: stages {sorted(by_stage)} profiled, expected 0..{pp - 1}")
        stages = [by_stage[i] for i in range(pp)]
        if any(s.forward_ns <= 0 or s.backward_ns <= 0 for s in stages):
            raise ValueError(f"{args.profile}: the profile has no forward/backward times (re-profile the job)")
        m = args.micro_batches or stages[0].num_microbatches
        measured_comm = _p2p_latency(stages)
        gpus = args.gpus or len(profile.stages) * args.tp
        return JobShape(
            gpus=gpus,
            pp=pp,
            tp=args.tp,
            microbatches=m,
            chunks=args.chunks,
            schedule=args.schedule,
            forward=tuple(s.forward_ns / 1e9 for s in stages),
            backward=tuple(s.backward_ns / 1e9 for s in stages),
            comm_s=comm if comm is not None else measured_comm or 0.0,
            comm_source="--p2p-latency"
            if comm is not None
            else "measured: each stage's first wait less the forwards before it"
            if measured_comm is not None
            else "not measurable from the profile",
            step_time_s=step or max(s.step_time_ns for s in stages) / 1e9,
            global_batch=args.global_batch,
            microbatch_size=args.micro_batch_size,
            measured_share=tuple(s.bubble_fraction for s in stages) if m == stages[0].num_microbatches else (),
            source=f"profile {Path(args.profile).name} ({stages[0].framework}, {stages[0].steps} steps profiled,"
            " median step and per micro-batch times)",
        )
    if args.pp is None:
        raise ValueError("give the job's shape (--pp, --micro-batches or --global-batch, ...) or --profile FILE")
    dp_gpus = args.pp * args.tp
    gpus = args.gpus or dp_gpus
    m = args.micro_batches
    if m is None:
        if args.global_batch is None or args.micro_batch_size is None:
            raise ValueError("give --micro-batches, or --global-batch with --micro-batch-size")
        dp = gpus // dp_gpus if gpus % dp_gpus == 0 else 0
        if dp == 0 or args.global_batch % (args.micro_batch_size * dp):
            raise ValueError(
                f"--global-batch {args.global_batch} does not split into {gpus} GPUs / (pp x tp = {dp_gpus})"
                f" replicas x micro-batches of {args.micro_batch_size}"
            )
        m = args.global_batch // (args.micro_batch_size * dp)
    if args.forward or args.backward:
        if not (args.forward and args.backward):
            raise ValueError("give both --forward and --backward (or --ratio with --step-time)")
        forward, backward = _times(args.forward, args.pp, "forward"), _times(args.backward, args.pp, "backward")
        absolute = True
    else:
        f, sep, b = args.ratio.partition(":")
        try:
            ratio = (float(f), float(b)) if sep else (0.0, 0.0)
        except ValueError:
            ratio = (0.0, 0.0)
        if not (ratio[0] > 0 and ratio[1] > 0):
            raise ValueError(f"--ratio expects F:B with positive numbers, got {args.ratio!r}")
        forward, backward, absolute = (ratio[0],) * args.pp, (ratio[1],) * args.pp, False
        if step is None:
            raise ValueError("give --step-time (with --ratio), or --forward and --backward per micro-batch")
    return JobShape(
        gpus=gpus,
        pp=args.pp,
        tp=args.tp,
        microbatches=m,
        chunks=args.chunks,
        schedule=args.schedule,
        forward=forward,
        backward=backward,
        absolute=absolute,
        comm_s=comm or 0.0,
        comm_source="--p2p-latency" if comm is not None else "none given",
        step_time_s=step,
        global_batch=args.global_batch,
        microbatch_size=args.micro_batch_size,
    )


def _p2p_latency(stages: list[StageProfile]) -> float | None:
    """The hand-over latency a profile shows, in seconds; None if it cannot tell.

    Stage ``s`` first waits for the forwards of micro-batch 0 on the stages before it
    and ``s`` hand-overs: its first bubble (``sF0``) less those forwards, over ``s``.
    """
    estimates: list[float] = []
    for s, stage in enumerate(stages[1:], start=1):
        head = stage.bubble(f"{s}F0")
        if head is not None:
            before = sum(st.forward_ns for st in stages[:s])
            estimates.append(max(head.duration_ns - before, 0) / s / 1e9)
    return statistics.median(estimates) if estimates else None


def _pairs(pairs: list[str], option: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"{option} expects NAME=VALUE, got {pair!r}")
        out[name] = value
    return out


def _step_from_estimates(paths: list[str]) -> dict[str, float]:
    """Per task target (``module:Class``), its median step time over every step kind measured."""
    out: dict[str, float] = {}
    for path in paths:
        key, kinds = read_estimates_file(Path(path))
        recent = [d for times in kinds.values() for d in times.recent if d > 0]
        if not recent:
            raise ValueError(f"{path}: no step times measured in it")
        out[key.target] = statistics.median(recent) / 1e9
    return out


def tasks_from_args(args: argparse.Namespace) -> tuple[TaskShare, ...]:
    """The side-task mix of ``--task`` and what is known of each task.

    Raises:
        ValueError: No task, shares that do not add up, or an option naming a task not in the mix.
    """
    from freeride.tasks.targets import resolve

    if not args.task:
        names = ", ".join(row.task for row in MEASURED)
        raise ValueError(f"give the side-task mix: --task NAME[=SHARE] (measured: {names}; or any task with --use)")
    shares: dict[str, float | None] = {}
    for item in args.task:
        name, sep, raw = item.partition("=")
        if not name or name in shares:
            raise ValueError(f"--task: {item!r} is empty or names a task twice")
        shares[name] = parse_share(raw) if sep else None
    given = sum(v for v in shares.values() if v is not None)
    missing = [n for n, v in shares.items() if v is None]
    if given > 1 + 1e-9 or (not missing and abs(given - 1) > 1e-6):
        raise ValueError(f"--task shares add up to {given:g}: they must add up to 1 (100%)")
    for name in missing:
        shares[name] = (1 - given) / len(missing)
    uses, inters = _pairs(args.use, "--use"), _pairs(args.interference, "--interference")
    steps = {n: parse_duration_ns(t) / 1e9 for n, t in _pairs(args.task_step, "--task-step").items()}
    rates = dict(parse_throughputs(args.side_throughput))
    for option, named in (("--use", uses), ("--interference", inters), ("--task-step", steps)):
        unknown = sorted(set(named) - set(shares))
        if unknown:
            raise ValueError(f"{option} names {unknown}, which are not in the mix (--task)")
    by_target = _step_from_estimates(args.estimates)
    tasks: list[TaskShare] = []
    for name, share in shares.items():
        assert share is not None
        use: MeasuredUse | None = measured_for(name)
        if name in uses:
            raw = uses[name]
            use = (
                DEMO
                if raw == "demo"
                else MeasuredUse(
                    task=name,
                    use=parse_share(raw),
                    interference=parse_share(inters[name]) if name in inters else None,
                    job="a run measured by the user",
                    steps=0,
                    source="--use on the command line",
                )
            )
        elif name in inters and use is not None:
            use = replace(use, interference=parse_share(inters[name]), source=use.source + "; --interference given")
        step = steps.get(name)
        if step is None:
            try:
                step = by_target.get(resolve(name))
            except ValueError:
                step = None
        tasks.append(TaskShare(task=name, share=share, use=use, step_s=step, cheap_rate=rates.get(name)))
    return tuple(tasks)


def _scale(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"--scale expects GPU counts like 1024,2048, got {text!r}")
    return sizes


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}%}"


def _row_text(row: ScaleRow) -> str:
    if row.error:
        return f"{row.gpus:>7}  cannot run: {row.error}"
    return (
        f"{row.gpus:>7} {row.dp:>6} {row.microbatches:>5} {row.step_s:>9.3g} {_pct(row.bubble_share):>8}"
        f" {row.harvested_gpu_h_day:>12,.0f} {_pct(row.saving, 2):>8} {_pct(row.interference, 2):>12}"
    )


def plan_text(plan: Plan) -> str:
    """The plan as a table for a terminal, its assumptions under it."""
    s = plan.shape
    lines = [
        f"FreeRide plan: {s.gpus} GPUs = pp {s.pp} x tp {s.tp} x dp {s.dp}, {s.schedule}, m={s.microbatches}"
        + (f", v={s.chunks}" if s.chunks > 1 else "")
        + "; mix: "
        + ", ".join(f"{t.task} {t.share:.0%}" for t in plan.tasks),
        "",
        f"{'stage':>5} {'bubble share':>12} {'measured':>8} {'usable':>8} {'bubbles':>7} {'longest':>9}",
    ]
    for st in plan.stages:
        lines.append(
            f"{st.stage:>5} {_pct(st.bubble_share):>12} {_pct(st.measured_share):>8} {_pct(st.usable_share):>8}"
            f" {st.windows:>7} {format_ns(round(st.longest_s * 1e9)):>9}"
        )
    mean = sum(st.bubble_share for st in plan.stages) / len(plan.stages)
    measured = [st.measured_share for st in plan.stages if st.measured_share is not None]
    lines.append(
        f"{'all':>5} {_pct(mean):>12} {_pct(sum(measured) / len(measured) if measured else None):>8}"
        f" {_pct(sum(st.usable_share for st in plan.stages) / len(plan.stages)):>8}"
    )
    head = (
        f"{'GPUs':>7} {'dp':>6} {'m':>5} {'step (s)':>9} {'bubble':>8} {'GPU-h/day':>12} {'saving':>8}"
        f" {'interference':>12}"
    )
    lines += ["", "harvested per day, cost saving and expected interference:", head, _row_text(plan.job), ""]
    lines += ["at scale:", head, *(_row_text(r) for r in plan.scale), "", "assumptions:"]
    lines += [f"  - {a}" for a in plan.assumptions]
    return "\n".join(lines)


def plan_dict(plan: Plan) -> dict[str, Any]:
    out = asdict(plan)
    out["use"] = plan.use
    return out


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        shape = shape_from_args(args)
        tasks = tasks_from_args(args)
    except OSError as exc:
        raise ValueError(f"cannot read {exc.filename}: {exc.strerror}") from exc
    prices = Prices(train_gpu_per_hour=args.train_gpu_price, side_gpu_per_hour=args.side_gpu_price)
    plan = make_plan(shape, tasks, PlanOptions(prices=prices, scale=_scale(args.scale)))
    print(json.dumps(plan_dict(plan), indent=2) if args.json else plan_text(plan))
    return 0
