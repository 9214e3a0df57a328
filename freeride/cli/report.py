"""``freeride report``: bubble share, harvested share, slowdown and cost saving of a traced run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from freeride.cli.common import Subparsers

__all__ = ["add_parsers", "cmd_report"]


def cmd_report(args: argparse.Namespace) -> int:
    import json

    from freeride.observe.report import Prices, ReportOptions, build_report, parse_throughputs
    from freeride.observe.timeline import load_trace, merge_traces

    options = ReportOptions(
        prices=Prices(
            train_gpu_per_hour=args.train_gpu_price, side_gpu_per_hour=args.side_gpu_price, train_gpus=args.train_gpus
        ),
        throughputs=parse_throughputs(args.side_throughput),
        warmup_steps=args.warmup,
    )
    paths = [Path(t) for t in args.trace]
    try:
        traces = [load_trace(path) for path in paths]
        baseline = load_trace(Path(args.baseline)) if args.baseline else None
    except OSError as exc:
        print(f"freeride: cannot read trace: {exc}", file=sys.stderr)
        return 2
    if len(traces) == 1:
        trace = traces[0]
    else:  # one job's nodes: each named by its file, or by its folder where the files share a name
        names = [path.stem for path in paths]
        if len(set(names)) < len(names):
            names = [path.parent.name or path.stem for path in paths]
        if len(set(names)) < len(names):
            names = [f"node{i}" for i in range(len(paths))]
        trace = merge_traces(list(zip(names, traces, strict=True)))
    report = build_report(trace, options, baseline)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text())
    return 0


def add_parsers(subs: Subparsers) -> None:
    s = subs.add_parser(
        "report",
        help="bubble share, harvested share, slowdown and cost saving of a traced run",
        description="Read a trace of `freeride serve --trace`, or one per node of a multi-node job (and a baseline"
        " trace without side tasks).",
    )
    s.add_argument(
        "trace", metavar="TRACE", nargs="+", help="a trace; several: one job's traces from its nodes, one report of all"
    )
    s.add_argument("--baseline", metavar="TRACE", help="trace of the same job without side tasks (for the slowdown)")
    s.add_argument("--train-gpu-price", type=float, default=3.96, help="$ per hour of one training GPU")
    s.add_argument("--side-gpu-price", type=float, default=0.18, help="$ per hour of the cheap GPU for side tasks")
    s.add_argument("--train-gpus", type=int, default=0, help="training GPUs of the job (default: devices in TRACE)")
    s.add_argument(
        "--side-throughput",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME=STEPS_PER_S",
        help="steps/s of a task (name or glob) alone on the cheap GPU (repeatable)",
    )
    s.add_argument("--warmup", type=int, default=1, help="steps left out at the start (default 1)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(fn=cmd_report)
