"""The ``freeride`` command: its parser (each command adds its own) and its exit statuses."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import freeride
from freeride import auth
from freeride.cli import cluster, keys, launch, profile, report, serve, sim, status, submit
from freeride.cli.plan import add_plan_parser
from freeride.gpu.mps import MpsError
from freeride.transport import ManagerUnreachable

__all__ = ["build_parser", "main", "parse_args"]


_EPILOG = """\
typical use:
  freeride serve &                                   # one per node, beside the training job
  freeride launch -- torchrun --nproc_per_node 4 train.py ...   # unmodified training script
  freeride submit freeride.sidetasks.pagerank:PageRank --opt nodes=200000
  freeride status
try it without a training job: freeride demo
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="freeride",
        description="Run side tasks inside the pipeline bubbles of DeepSpeed, Megatron and PyTorch pipeline"
        " training jobs.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"freeride {freeride.__version__}")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    subs = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    serve.add_parsers(subs)
    submit.add_parsers(subs)  # submit, cancel
    status.add_parsers(subs)
    report.add_parsers(subs)
    keys.add_parsers(subs)
    launch.add_parsers(subs)
    profile.add_parsers(subs)  # profile, profile-task
    cluster.add_parsers(subs)
    add_plan_parser(subs)
    sim.add_parsers(subs)  # sim, demo
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line's options; ``command``: what follows the first ``--`` (a command to run, never ours).

    A ``--config`` file's options are defaults the command line overrides.
    """
    parser = build_parser()
    argv = list(argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        args.config_parser.set_defaults(**serve.config_defaults(args.config, args.config_parser))
        args = parser.parse_args(argv)
    args.command = command
    return args


def _run(argv: Sequence[str] | None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.fn(args))
    except ManagerUnreachable as exc:
        print(f"freeride: {exc}", file=sys.stderr)
        return 3
    except auth.Refused as exc:
        print(f"freeride: {exc}", file=sys.stderr)
        return 2
    except MpsError as exc:  # serve --mps where MPS cannot start: what the control program said
        print(f"freeride: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"freeride: {exc}", file=sys.stderr)
        return 2


def _stdout_to_devnull() -> None:
    # Python flushes stdout again at exit; into a closed pipe that prints "Exception ignored ... BrokenPipeError"
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a file (embedded use): nothing is flushed at exit
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``freeride`` command; returns its exit status.

    A reader that closes our stdout early (``freeride report trace.json | head``)
    ends the command quietly with 141, the status a shell gives a process ended
    by SIGPIPE; Ctrl-C ends it with 130, as a shell reports SIGINT, without a
    traceback.
    """
    try:
        try:
            return _run(argv)
        finally:
            # flush here, where a closed pipe can be caught, rather than at interpreter exit
            sys.stdout.flush()
    except BrokenPipeError:
        _stdout_to_devnull()
        return 141
    except KeyboardInterrupt:  # Ctrl-C: what was started has been stopped on the way out
        print("freeride: interrupted", file=sys.stderr)
        return 130
