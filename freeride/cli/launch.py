"""``freeride launch``: a training command with FreeRide's hooks in every rank, beside the node's manager."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from freeride import auth
from freeride.cli import common, serve
from freeride.cli.common import Subparsers
from freeride.transport import ControlClient

__all__ = ["add_parsers", "cmd_launch", "launch_serve_argv", "node_manager"]


def cmd_launch(args: argparse.Namespace) -> int:
    from freeride.backends.launch import launch_env

    if not args.command:
        raise SystemExit("freeride: give the training command after --, e.g. freeride launch -- torchrun ...")
    endpoints = common.endpoints(args)
    env = launch_env(os.environ, events=endpoints.events)
    common.export_keys_dir(args, env)
    path = common.find_command(args.command, env)
    try:
        if endpoints.events.startswith("ipc://"):
            auth.check_ipc_socket(Path(endpoints.events[6:]))
        if not args.no_manager:
            node_manager(args)
    except auth.Refused as exc:  # never talk to what may be another user's; never stop the training either
        print(f"freeride: no manager: {exc}; training runs without FreeRide", file=sys.stderr)
        env = dict(os.environ)
    try:
        os.execve(path, list(args.command), env)
    except OSError as exc:  # found but not runnable, e.g. a script with a bad #! line
        print(f"freeride: cannot run {args.command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 126


def node_manager(args: argparse.Namespace) -> None:
    """Find the node's manager or start one; the training runs whatever happens to it."""
    from freeride.cli.node_manager import ManagerNotStarted, StartOptions, ensure_manager

    endpoints = common.endpoints(args)
    curve = auth.load_client_keys(common.keys_dir(args)) if endpoints.control.startswith("tcp://") else None
    options = StartOptions(
        endpoints=endpoints,
        runtime_dir=common.runtime_dir(args),
        serve_argv=tuple(launch_serve_argv(args)),
        keep=args.keep_manager,
        start_timeout_s=args.manager_timeout,
    )
    try:
        found = ensure_manager(options, lambda t: ControlClient(endpoints.control, timeout_s=t, curve=curve))
    except ManagerNotStarted as exc:
        print(f"freeride: no manager: {exc}; training runs without FreeRide", file=sys.stderr)
        return
    for note in found.notes:
        print(f"freeride: {note}", file=sys.stderr)
    if found.started:
        after = "stays after the job" if args.keep_manager else "exits when the jobs launched here have ended"
        print(f"freeride: started a manager (pid {found.pid}, log {found.log}); it {after}", file=sys.stderr)
    else:
        print(f"freeride: using the manager (pid {found.pid or '?'}) of {options.runtime_dir}", file=sys.stderr)


def launch_serve_argv(args: argparse.Namespace) -> list[str]:
    """``freeride serve`` as launch would start it, checked now: bad options fail before the job starts."""
    import shlex

    extra = shlex.split(args.serve_args)
    given = sorted({a.partition("=")[0] for a in extra} & {"--runtime-dir", "--tcp", "--keys-dir", "--exit-with-jobs"})
    if given:
        raise ValueError(f"--serve-args: give {', '.join(given)} to launch itself, which passes it to serve")
    own = ["--runtime-dir", str(common.runtime_dir(args))]
    if args.tcp:
        own += ["--tcp", args.tcp, "--keys-dir", str(common.keys_dir(args))]
    argv = [*own, *([] if args.keep_manager else ["--exit-with-jobs"]), *extra]
    try:
        serve.serve_config(_serve_parser().parse_args(["serve", *argv]))
    except SystemExit:  # argparse printed what is wrong
        print("freeride: --serve-args: not options of `freeride serve` (see freeride serve --help)", file=sys.stderr)
        raise SystemExit(2) from None
    return [sys.executable, "-P", "-m", "freeride", "--log-level", args.log_level, "serve", *argv]


def _serve_parser() -> argparse.ArgumentParser:
    """``freeride serve``'s own parser, to check the options launch would start it with."""
    parser = argparse.ArgumentParser(prog="freeride")
    serve.add_parsers(parser.add_subparsers(dest="cmd", required=True))
    return parser


def add_parsers(subs: Subparsers) -> None:
    s = subs.add_parser(
        "launch",
        help="run a training command with FreeRide's hooks in every rank",
        usage="freeride launch [--runtime-dir DIR] [--keep-manager] [--serve-args ARGS] -- COMMAND ...",
        description="Find the node's manager, or start one, then run COMMAND with FreeRide's hooks in every rank"
        " (docs/launchers.md).",
    )
    common.add_runtime(s)
    s.add_argument(
        "--keep-manager",
        action="store_true",
        help="a manager this launch starts stays after the job (default: it checkpoints its side tasks and exits"
        " once every job launched on this runtime dir has ended)",
    )
    s.add_argument(
        "--serve-args",
        default="",
        metavar="ARGS",
        help="options for a manager this launch starts, as for `freeride serve`, e.g. '--side-priority same"
        " --profile job.json --state-dir DIR', or --serve-args=--mps (a running manager keeps its own)",
    )
    s.add_argument("--no-manager", action="store_true", help="neither look for nor start a manager")
    s.add_argument(
        "--manager-timeout", type=float, default=60.0, metavar="SECONDS", help="wait this long for a manager to answer"
    )
    s.set_defaults(fn=cmd_launch)
