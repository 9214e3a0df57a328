"""What every rank of the training scripts does around its steps: where it runs, and the JSON lines it prints."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import torch
from _args import CommonArgs  # tools/train is the scripts' directory

__all__ = ["done_record", "emit", "jsonl_file", "pin_cpu", "rank_device", "rank_env", "recv_fields"]


def rank_env() -> tuple[int, int, int]:
    """``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` as the launcher set them (one rank without a launcher)."""
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return rank, local_rank, world


def pin_cpu(rank: int) -> None:
    """Pin this process to one core (rank ``r`` to core ``r % nproc``) and one thread: a core plays a device."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})
    torch.set_num_threads(1)


def rank_device(args: CommonArgs, local_rank: int) -> torch.device:
    """The rank's device: on CPU the rank is pinned (:func:`pin_cpu`), on GPU its device becomes the current one."""
    if args.device == "cpu":
        pin_cpu(local_rank)
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


@contextlib.contextmanager
def jsonl_file(pattern: str, rank: int) -> Iterator[TextIO | None]:
    """``--jsonl``'s file for ``rank``, open for appending; ``None`` without one."""
    if not pattern:
        yield None
        return
    with open(pattern.format(rank=rank), "a", encoding="utf-8") as out:
        yield out


def emit(record: dict[str, Any], out: TextIO | None) -> None:
    """Print ``record`` as one JSON line, and append it to ``out`` if given."""
    line = json.dumps(record)
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())  # one write: ranks share the pipe
    if out is not None:
        out.write(line + "\n")
        out.flush()


def recv_fields(waits: list[tuple[int, int]]) -> dict[str, Any]:
    """A step record's ``recv_ms`` (the waits' total) and ``recv`` (each ``[start_ns, duration_ns]``)."""
    return {"recv_ms": round(sum(d for _, d in waits) / 1e6, 3), "recv": waits}


def done_record(rank: int, step_ms: list[float]) -> dict[str, Any]:
    """A rank's last record: the median step time, the first step (warm-up) left out where there are more."""
    median = statistics.median(step_ms[1:]) if len(step_ms) > 1 else step_ms[0]
    return {"rank": rank, "done": True, "median_step_ms": round(median, 3)}
