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

__all__ = ["add_parsers", "add_pipeline_options", "cmd_demo", "cmd_sim", "pipeline_argv", "sim_config"]


_COMPUTE_HELP = (
    "sleep: a stage waits out its compute time; spin: it burns its core until a wall deadline; cpu: until it had its"
    " compute time on the core (a side task sharing the core then delays it, as a side kernel delays a GPU)"
)


def add_pipeline_options(parser: argparse.ArgumentParser, *, compute: str) -> None:
    """Add the simulated pipeline's shape and compute options (those :func:`sim_config` reads) to ``parser``."""
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=1, help="model chunks per stage (interleaved)")
    parser.add_argument("--forward", default="10ms", help="forward time per micro-batch and stage (default 10ms)")
    parser.add_argument("--backward", default="20ms", help="backward time per micro-batch and stage (default 20ms)")
    parser.add_argument(
        "--compute", default=compute, choices=["sleep", "spin", "cpu"], help=f"{_COMPUTE_HELP} (default {compute})"
    )


def pipeline_argv(args: argparse.Namespace) -> tuple[str, ...]:
    """The options of :func:`add_pipeline_options` in ``args``, as a command line gives them."""
    return (
        *("--schedule", args.schedule, "--microbatches", str(args.microbatches), "--chunks", str(args.chunks)),
        *("--forward", args.forward, "--backward", args.backward, "--compute", args.compute),
    )


def sim_config(args: argparse.Namespace, *, endpoint: str, stages: int, steps: int) -> SimConfig:
    """The simulated job that the options of :func:`add_pipeline_options` in ``args`` describe.

    Raises:
        ValueError: a duration that does not parse.
    """
    from freeride.backends.sim import SimConfig

    return SimConfig(
        endpoint=endpoint,
        schedule=args.schedule,
        num_stages=stages,
        num_microbatches=args.microbatches,
        num_chunks=args.chunks,
        forward_s=parse_duration_ns(args.forward) / 1e9,
        backward_s=parse_duration_ns(args.backward) / 1e9,
        steps=steps,
        compute=args.compute,
    )


def _sim_config(args: argparse.Namespace, endpoint: str) -> SimConfig:
    """The simulated job of ``freeride sim`` and ``freeride demo``."""
    return sim_config(args, endpoint=endpoint, stages=args.stages, steps=args.steps)


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
        add_pipeline_options(s, compute="sleep")
        s.add_argument("--stages", type=int, default=2)
        s.add_argument("--steps", type=int, default=60 if name == "demo" else 100)
        if name == "demo":
            s.add_argument("--task", default="graph-sgd", help="sample side task per stage (see submit --list)")
            s.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="side-task option")
        s.set_defaults(fn=cmd_sim if name == "sim" else cmd_demo)
