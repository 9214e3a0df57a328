"""``freeride submit --imperative``: the options of an unmodified program, checked before they are sent.

A relative path is the submitting shell's: ``--cwd`` and a program given as
``./run.sh`` are resolved here, against the client's working directory, since
the manager runs elsewhere. The environment is the client's (see
:mod:`freeride.tasks.programs` for what the program gets and why).
"""

from __future__ import annotations

import argparse
import os

from freeride import protocol as p
from freeride.tasks.programs import MAX_SYNC_EVERY, parse_env, spec_problem

__all__ = ["PROGRAM_OPTIONS", "add_program_options", "cancel_outcome", "program_spec"]

PROGRAM_OPTIONS = ("--cwd", "--env", "--clean-env", "--sync-every", "--progress-file", "--progress-pattern")
"""The options that only apply to an imperative program."""


def add_program_options(parser: argparse.ArgumentParser) -> None:
    """The ``--imperative`` options of ``freeride submit``."""
    group = parser.add_argument_group("imperative programs (with --imperative)")
    group.add_argument(
        "--cwd",
        metavar="DIR",
        help="the program's working directory (default: its own, STATE_DIR/tasks/NAME); relative to this shell's",
    )
    group.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for the program (repeatable), over this shell's environment",
    )
    group.add_argument(
        "--clean-env",
        action="store_true",
        help="send only the --env variables, not this shell's environment (the program still gets PATH, HOME "
        "and the locale from the manager)",
    )
    group.add_argument(
        "--sync-every",
        type=int,
        default=0,
        metavar="N",
        help="a PyTorch program synchronizes CUDA every N optimizer steps, so that at most N steps of kernels "
        "are queued when it is frozen (default 0: never)",
    )
    group.add_argument(
        "--progress-file",
        metavar="PATH",
        help="a file the program writes its step (a number) or metrics (a JSON object) to; relative to its cwd",
    )
    group.add_argument(
        "--progress-pattern",
        metavar="REGEX",
        help=r"a regex matched against each line the program prints, e.g. 'step (?P<step>\d+) loss (?P<loss>[\d.]+)'"
        ": named groups are metrics, `step` its step count",
    )


def program_spec(args: argparse.Namespace) -> p.ProgramSpec:
    """The spec of ``freeride submit --imperative -- PROGRAM ARGS``.

    Raises:
        SystemExit: With an actionable message on a bad option.
    """
    argv = list(args.command)
    if "/" in argv[0] and not os.path.isabs(argv[0]):
        argv[0] = os.path.abspath(argv[0])
    cwd = ""
    if args.cwd:
        cwd = os.path.abspath(args.cwd)
        if not os.path.isdir(cwd):
            raise SystemExit(f"freeride: --cwd {args.cwd!r} is not a directory (resolved to {cwd})")
    if not 0 <= args.sync_every <= MAX_SYNC_EVERY:
        raise SystemExit(f"freeride: --sync-every must be in 0..{MAX_SYNC_EVERY}, got {args.sync_every}")
    try:
        env = {**({} if args.clean_env else dict(os.environ)), **parse_env(args.env)}
    except ValueError as exc:
        raise SystemExit(f"freeride: {exc}") from None
    spec = p.ProgramSpec(
        argv=argv,
        name=args.name or "",
        cwd=cwd,
        env=env,
        sync_every=args.sync_every,
        progress_file=args.progress_file or "",
        progress_pattern=args.progress_pattern or "",
    )
    problem = spec_problem(spec)
    if problem:
        raise SystemExit(f"freeride: {problem}")
    return spec


def cancel_outcome(kind: p.TaskKind) -> str:
    """What a cancel leaves behind, in words."""
    if kind == "imperative":
        return (
            "its program is stopped; what it wrote to its working directory stays; "
            "submitted again, it starts from the beginning"
        )
    return "its checkpoint is kept; submit it again to resume"
