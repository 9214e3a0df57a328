"""``freeride submit`` and ``freeride cancel``: side tasks in and out of a running manager."""

from __future__ import annotations

import argparse
import sys

import msgspec

from freeride import protocol as p
from freeride.cli import common
from freeride.cli.common import Subparsers
from freeride.cli.program import PROGRAM_OPTIONS, add_program_options, cancel_outcome, program_spec
from freeride.cli.submission import await_start, check_submission, report_start
from freeride.units import parse_bytes, parse_duration_ns

__all__ = ["add_parsers", "cmd_cancel", "cmd_submit"]


def _sm_share(percent: int) -> int:
    if percent != -1 and not 1 <= percent <= 100:
        raise SystemExit(f"freeride: --sm-share must be a percentage in 1..100, got {percent}")
    return percent


def cmd_submit(args: argparse.Namespace) -> int:
    from freeride.tasks.targets import catalog, program_command, programs, resolve

    if args.list:
        from freeride.sidetasks import DESCRIPTIONS

        rows = [*catalog().items(), *((name, f"(program) python -m {m}") for name, m in programs().items())]
        width = max((len(what) for _, what in rows), default=0)
        for name, what in rows:
            print(f"{name:16} {what:{width}} {DESCRIPTIONS.get(name, '')}".rstrip())
        return 0
    if args.target in programs():  # a registered plain program: run it as an imperative task
        args.imperative, args.command = True, program_command(args.target) + list(args.command)
    if args.imperative:
        if not args.command:
            raise SystemExit("freeride: give the program after --, e.g. freeride submit --imperative -- python x.py")
        if args.fill:
            raise SystemExit("freeride: --fill applies to iterative tasks only, not to --imperative programs")
        spec: p.TaskSpec = program_spec(args)
    else:
        given = [o for o in PROGRAM_OPTIONS if getattr(args, o.lstrip("-").replace("-", "_"))]
        if given:
            raise SystemExit(f"freeride: {', '.join(given)} only apply to --imperative programs")
        if not args.target:
            raise SystemExit("freeride: give a side task as module:Class (see freeride submit --list)")
        try:
            target = resolve(args.target)
        except ValueError as exc:
            raise SystemExit(f"freeride: {exc}") from None
        iterative = p.IterativeSpec(
            target=target,
            name=args.name or "",
            options=common.parse_opts(args.opt),
            step_time_ns=parse_duration_ns(args.step_time) if args.step_time else -1,
            fill=args.fill,
        )
        spec = check_submission(iterative)
    spec = msgspec.structs.replace(
        spec,
        peak_memory=parse_bytes(args.peak_memory) if args.peak_memory else spec.peak_memory,
        device=args.device or "",
        max_restarts=args.max_restarts,
        sm_share=_sm_share(args.sm_share),
    )
    with common.control(args) as client:
        reply = client.request(p.Submit(spec=spec))
        started = await_start(client, reply.task_id, args.wait) if isinstance(reply, p.Submitted) else None
    match reply:
        case p.Submitted(task_id=tid, device=device):
            print(f"task {tid} submitted; " + (f"placed on {device}" if device else "waiting for a device"))
            return report_start(started)
        case p.Rejected(reason=reason):
            print(f"freeride: rejected: {reason}", file=sys.stderr)
            return 2
        case _:
            print(f"freeride: unexpected reply {reply!r}", file=sys.stderr)
            return 1


def cmd_cancel(args: argparse.Namespace) -> int:
    with common.control(args) as client:
        reply = client.request(p.Cancel(task_id=args.task_id))
    if isinstance(reply, p.Cancelled):
        print(f"task {reply.task_id} cancelled ({cancel_outcome(reply.kind)})")
        return 0
    print(f"freeride: {getattr(reply, 'reason', reply)}", file=sys.stderr)
    return 2


def add_parsers(subs: Subparsers) -> None:
    s = subs.add_parser("submit", help="submit a side task", description="Submit a side task to a running manager.")
    common.add_runtime(s)
    s.add_argument("target", nargs="?", help="module:Class of an iterative task, or a name from --list")
    s.add_argument("--list", action="store_true", help="list the packaged sample side tasks")
    s.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="task option (repeatable)")
    s.add_argument("--name", help="task name; a task submitted again under its name resumes from its checkpoint")
    s.add_argument("--peak-memory", metavar="SIZE", help="peak device memory, e.g. 2G (placement only fits it)")
    s.add_argument("--step-time", metavar="DURATION", help="expected step time, e.g. 5ms, until measured")
    s.add_argument("--device", help="pin to a device, e.g. cuda:1")
    s.add_argument("--max-restarts", type=int, default=3, help="restarts from checkpoint after a crash")
    s.add_argument(
        "--sm-share",
        type=int,
        default=-1,
        metavar="PCT",
        help="percent of the GPU's SMs the task may occupy under MPS (default 75: the rest stays free for "
        "the trainer's NCCL kernels)",
    )
    s.add_argument(
        "--fill",
        action="store_true",
        help="fill the ends of bubbles: the task gets a bubble only once its device's other tasks gave it back "
        "(e.g. PageRank beside ResNet-50 training)",
    )
    s.add_argument("--imperative", action="store_true", help="run an unmodified program (give it after --)")
    add_program_options(s)
    s.add_argument(
        "--wait",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="wait this long for the task to start, so that a failing setup shows here (0: do not wait)",
    )
    s.add_argument("--timeout", type=float, default=5.0, help=argparse.SUPPRESS)
    s.set_defaults(fn=cmd_submit)

    s = subs.add_parser("cancel", help="cancel a side task (an iterative task checkpoints first; a program is stopped)")
    common.add_runtime(s)
    s.add_argument("task_id", type=int)
    s.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the manager")
    s.set_defaults(fn=cmd_cancel)
