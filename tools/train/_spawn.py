"""Self-spawned ranks for the CPU training scripts, as torchrun would start them.

``run_ranks(train, args, world)`` starts ``world`` processes with the
environment ``torch.distributed`` reads (RANK, WORLD_SIZE, MASTER_ADDR/PORT...),
calls ``train(args)`` in each, and stops the others as soon as one fails (they
would wait for it forever). ``run_script(train, args, name=...)`` is a script's
``main``: ``train(args)`` in this process when a launcher started it, else in
``args.spawn`` ranks.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
from collections.abc import Callable
from typing import TypeVar

from _args import CommonArgs  # tools/train is the scripts' directory

__all__ = ["run_ranks", "run_script"]

A = TypeVar("A")
C = TypeVar("C", bound=CommonArgs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rank(train: Callable[[A], None], index: int, world: int, args: A, port: int) -> None:
    os.environ.update(
        RANK=str(index),
        LOCAL_RANK=str(index),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    train(args)


def run_ranks(train: Callable[[A], None], args: A, world: int, *, name: str) -> int:
    """Run ``train(args)`` in ``world`` spawned ranks; the first failing rank's exit code, else 0."""
    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    ranks = [
        ctx.Process(target=_rank, args=(train, i, world, args, port), name=f"{name}-rank{i}") for i in range(world)
    ]
    for proc in ranks:
        proc.start()
    code = 0
    live = list(ranks)
    while live:
        multiprocessing.connection.wait([proc.sentinel for proc in live])
        for proc in [proc for proc in live if proc.exitcode is not None]:
            live.remove(proc)
            if proc.exitcode and not code:
                code = proc.exitcode if proc.exitcode > 0 else 1
                print(f"{proc.name} exited with {proc.exitcode}; stopping the others", file=sys.stderr)
                for other in live:
                    other.terminate()
    return code


def run_script(train: Callable[[C], None], args: C, *, name: str) -> int:
    """Run ``train(args)`` as the rank a launcher started, or in ``args.spawn`` ranks started here; the exit code."""
    if not args.spawn:
        train(args)
        return 0
    return run_ranks(train, args, args.spawn, name=name)
