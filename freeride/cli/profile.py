"""``freeride profile`` (a job's bubbles) and ``freeride profile-task`` (a side task's step kinds)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from freeride.cli import common
from freeride.cli.common import Subparsers
from freeride.cli.profile_task import DEFAULT_SAMPLES, DEFAULT_STEPS
from freeride.transport import default_runtime_dir
from freeride.transport.endpoints import RUNTIME_DIR_ENV

__all__ = ["add_parsers", "cmd_profile", "cmd_profile_task"]


def _add_profile_options(s: argparse.ArgumentParser) -> None:
    from freeride.cli.profile_run import DEFAULT_PROFILE_STEPS

    s.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_PROFILE_STEPS,
        help=f"stop the job once every rank ran this many steps (default {DEFAULT_PROFILE_STEPS}; 0: to its end)",
    )
    s.add_argument("--picture", metavar="PNG", help="also draw where each stage's bubbles fall in one step")


def cmd_profile(args: argparse.Namespace) -> int:
    from freeride.cli.profile_run import ProfileOptions, run_profile
    from freeride.observe.picture import require_matplotlib

    if not args.command:
        raise SystemExit("freeride: give the training command after --")
    if args.picture:
        try:
            require_matplotlib()  # before the job runs, not after
        except ImportError as exc:
            print(f"freeride: --picture: {exc}", file=sys.stderr)
            return 2
    env = dict(os.environ)
    common.export_keys_dir(args, env)
    common.find_command(args.command, env)
    events = common.endpoints(args).events
    outcome = run_profile(
        ProfileOptions(command=args.command, out=Path(args.out), events=events, steps=args.steps, env=env)
    )
    print(f"freeride: {outcome.message}", file=sys.stderr if outcome.exit_code else sys.stdout)
    if outcome.profile is not None and args.picture:
        from freeride.observe.picture import render_profile

        render_profile(outcome.profile, Path(args.picture))
        print(f"freeride: picture of one step written to {args.picture}")
    return outcome.exit_code


def cmd_profile_task(args: argparse.Namespace) -> int:
    from freeride.auth import ensure_private_dir
    from freeride.cli.profile_task import ProfileTaskOptions, profile_task  # imports torch only to run the task

    # by default where `freeride serve` keeps its state
    state_dir = Path(args.state_dir) if args.state_dir else ensure_private_dir(common.runtime_dir(args)) / "state"
    options = ProfileTaskOptions(
        target=args.target,
        options=common.parse_opts(args.opt),
        state_dir=state_dir,
        device=args.device,
        cores=common.parse_cores(args.cores),
        samples=args.samples,
        steps=args.steps,
        bubble_ms=args.bubble_ms,
    )
    ensure_private_dir(state_dir, what="state dir", strict=False)
    result = profile_task(options)
    print(result.table())
    if result.finished:
        print("freeride: the task finished before every step kind was measured enough", file=sys.stderr)
    return 0


def add_parsers(subs: Subparsers) -> None:
    s = subs.add_parser(
        "profile",
        help="run a few training steps and write a bubble profile",
        usage="freeride profile --out FILE [--steps N] [--picture PNG] [--runtime-dir DIR] -- COMMAND ...",
    )
    common.add_runtime(s)
    s.add_argument("--out", required=True, metavar="FILE")
    _add_profile_options(s)
    s.set_defaults(fn=cmd_profile)

    s = subs.add_parser(
        "profile-task",
        help="measure a side task's step kinds alone, so that its first run under serve knows them",
        description="Run a side task alone and keep the measured time of each of its step kinds where"
        " `freeride serve` reads them (STATE_DIR/estimates); submit it later with the same options.",
    )
    s.add_argument("target", help="module:Class of an iterative task, or a name from `freeride submit --list`")
    s.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", help="task option (repeatable)")
    s.add_argument("--device", default="cpu:0", help="cpu:N or cuda:N (default cpu:0)")
    s.add_argument(
        "--cores",
        default="",
        metavar="LIST",
        help="CPU cores of the stage the task will share, e.g. 0-3 (default: none named, one thread)",
    )
    s.add_argument(
        "--samples",
        type=int,
        default=DEFAULT_SAMPLES,
        help=f"stop once every step kind ran this many times (default {DEFAULT_SAMPLES})",
    )
    s.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"stop after this many steps in any case ({DEFAULT_STEPS})"
    )
    s.add_argument(
        "--bubble-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="the typical bubble of the stage the task will share (`freeride status` shows it): a task that sizes"
        " its steps by the bubbles then measures the steps it will run (default 0: unknown)",
    )
    s.add_argument("--state-dir", metavar="DIR", help="the state dir of `freeride serve` (default RUNTIME_DIR/state)")
    s.add_argument(
        "--runtime-dir",
        metavar="DIR",
        help=f"the runtime dir of `freeride serve` (default ${RUNTIME_DIR_ENV} if set, else as for serve: here"
        f" {default_runtime_dir()}), if --state-dir is not given",
    )
    s.set_defaults(fn=cmd_profile_task)
