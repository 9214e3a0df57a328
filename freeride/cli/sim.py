"""``freeride sim`` and ``freeride demo``: the simulated pipeline, against a manager or with its own."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import TYPE_CHECKING

from freeride.cli import common
from freeride.cli.common import Subparsers
from freeride.units import format_ns, parse_duration_ns

if TYPE_CHECKING:
    from freeride.backends.sim import SimConfig

__all__ = ["add_parsers", "cmd_demo", "cmd_sim"]


def _sim_config(args: argparse.Namespace, endpoint: str) -> SimConfig:
    """The simulated job of ``freeride sim`` and ``freeride demo``, from their shared flags."""
    from freeride.backends.sim import SimConfig

    return SimConfig(
        endpoint=endpoint,
        schedule=args.schedule,
        num_stages=args.stages,
        num_microbatches=args.microbatches,
        num_chunks=args.chunks,
        forward_s=parse_duration_ns(args.forward) / 1e9,
        backward_s=parse_duration_ns(args.backward) / 1e9,
        steps=args.steps,
        compute=args.compute,
    )


def cmd_sim(args: argparse.Namespace) -> int:
    from freeride.backends.sim import SimPipeline

    common.export_keys_dir(args, os.environ)  # the simulated ranks' emitters read it
    with SimPipeline(_sim_config(args, common.endpoints(args).events)) as sim:
        results = sim.join()
    for r in results:
        med = sorted(r.step_ns)[len(r.step_ns) // 2] if r.step_ns else 0
        print(f"stage {r.stage}: {len(r.step_ns)} steps, median {format_ns(med)}, {r.dropped} events dropped")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from freeride.cli.demo import DemoOptions, run_demo

    # the demo runs its own manager, which fills in the endpoint
    options = DemoOptions(sim=_sim_config(args, endpoint=""), task=args.task)
    if args.opt or args.task != "graph-sgd":  # the default options suit only the default task
        options = dataclasses.replace(options, task_options=common.parse_opts(args.opt))
    report = run_demo(options)
    print(report.text())
    return 0 if report.ok else 1


def add_parsers(subs: Subparsers) -> None:
    for name, helptext in (
        ("sim", "run a simulated pipeline job against a running manager"),
        ("demo", "serve + simulated pipeline + sample side tasks, then a report"),
    ):
        s = subs.add_parser(name, help=helptext)
        if name == "sim":
            common.add_runtime(s)
        s.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
        s.add_argument("--stages", type=int, default=2)
        s.add_argument("--microbatches", type=int, default=4)
        s.add_argument("--chunks", type=int, default=1, help="model chunks per stage (interleaved)")
        s.add_argument("--steps", type=int, default=60 if name == "demo" else 100)
        s.add_argument("--forward", default="10ms", help="forward time per micro-batch and stage")
        s.add_argument("--backward", default="20ms", help="backward time per micro-batch and stage")
        s.add_argument(
            "--compute",
            default="sleep",
            choices=["sleep", "spin", "cpu"],
            help="spin burns the stage's core until a wall deadline; cpu until the stage had its compute time",
        )
        if name == "demo":
            s.add_argument("--task", default="graph-sgd", help="sample side task per stage (see submit --list)")
            s.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="side-task option")
        s.set_defaults(fn=cmd_sim if name == "sim" else cmd_demo)
