"""A small GPT trained with torch.distributed.pipelining's schedules, torchtitan-style, on CPU (gloo) or GPU.

Every rank prints one JSON line per training step (``rank``, ``stage``,
``step``, ``loss`` (the rank holding the last stage only, else null),
``step_ms``, ``cpu_ms``; with ``--recv-timers`` also ``recv_ms`` and ``recv``,
the schedule's p2p waits as ``[start_ns, duration_ns]`` on the monotonic clock,
timed by this script around torch's ``_wait_batch_p2p``). Launch it as any
torchrun job::

    torchrun --standalone --nproc_per_node 2 tools/train/torchpipe_gpt.py --steps 20
    torchrun --standalone --nproc_per_node 2 tools/train/torchpipe_gpt.py --schedule zbv
    python tools/train/torchpipe_gpt.py --spawn 2 --schedule interleaved   # starts its own ranks

The model (embedding, pre-norm blocks, head) is cut by hand into one
``PipelineStage`` per virtual stage: one per rank for ``1f1b`` and ``gpipe``,
``--vpp`` per rank for ``interleaved``, ``looped-bfs`` and ``interleaved-zb``
(stage ``s`` on rank ``s % p``) and two per rank for ``zbv`` and ``dualpipev``
(V-shaped: rank ``r`` holds ``r`` and ``2p-1-r``; ``dualpipev`` needs at least
``2p`` micro-batches). On CPU
each rank is pinned to one core and runs one thread. ``--compute sleep`` swaps
the blocks for ones that sleep a fixed time per micro-batch, so bubbles are
deterministic. Nothing here knows FreeRide: ``freeride launch`` attaches it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from _args import CommonArgs, add_common_args  # tools/train is the script's directory
from _layers import GPTSlice, arithmetic_batch
from _rank import done_record, emit, jsonl_file, rank_device, rank_env, recv_fields
from _spawn import run_script

__all__ = ["SCHEDULES", "SCHEDULE_CLASSES", "StageModel", "TrainArgs", "main", "parse_args"]

SCHEDULE_CLASSES = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""``--schedule`` -> the torch.distributed.pipelining class it runs."""
SCHEDULES = tuple(SCHEDULE_CLASSES)
SINGLE = ("1f1b", "gpipe")
"""One stage per rank."""
V_SHAPED = ("zbv", "dualpipev")
"""Two stages per rank, V-shaped: rank ``r`` holds ``r`` and ``2p-1-r``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainArgs(CommonArgs):
    """Command-line options, validated (the shared ones in :class:`CommonArgs`)."""

    schedule: str
    """One of :data:`SCHEDULES`."""
    vpp: int
    """Stages per rank with ``interleaved`` (``zbv`` always has 2, the others 1)."""

    def __post_init__(self) -> None:
        CommonArgs.__post_init__(self)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.vpp < 1:
            raise ValueError(f"vpp must be >= 1, got {self.vpp}")
        if self.schedule in SINGLE and self.vpp != 1:
            raise ValueError(f"vpp needs a multi-stage schedule, not {self.schedule}")
        if self.schedule in V_SHAPED and self.vpp != 2:
            raise ValueError(f"{self.schedule} runs exactly 2 stages per rank (--vpp 2)")

    @property
    def stages_per_rank(self) -> int:
        return self.vpp


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    ap.add_argument(
        "--vpp", type=int, default=None, help="stages per rank (multi-stage schedules: default 2; zbv, dualpipev: 2)"
    )
    ap.add_argument(
        "--stages", type=int, default=0, help="pipeline ranks: spawned here unless a launcher started the ranks"
    )
    ns = ap.parse_args(argv)
    world = os.environ.get("WORLD_SIZE")
    if ns.stages and world is not None and int(world) != ns.stages:
        ap.error(f"--stages {ns.stages} but the launcher started {world} ranks")
    if ns.stages and not ns.spawn and world is None:
        ns.spawn = ns.stages
    del ns.stages
    if ns.vpp is None:
        ns.vpp = 1 if ns.schedule in SINGLE else 2
    try:
        return TrainArgs(**vars(ns))
    except ValueError as exc:
        ap.error(str(exc))


# --------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------


class StageModel(GPTSlice):
    """One pipeline stage: embeds tokens if first, ends in the LM head if last.

    Its sleeping blocks return copies: zero-bubble schedules detach the input-gradient graph in place.
    """

    def __init__(self, args: TrainArgs, *, first: bool, last: bool, blocks: int) -> None:
        super().__init__(args, first=first, last=last, blocks=blocks, copy=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)
        out: torch.Tensor = self.blocks(x)
        if self.last:
            return self.logits(out)
        return out


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _stage_indices(args: TrainArgs, rank: int, world: int) -> list[int]:
    if args.schedule in V_SHAPED:
        return [rank, 2 * world - 1 - rank]
    return [rank + c * world for c in range(args.stages_per_rank)]


def _build(args: TrainArgs, rank: int, world: int, device: torch.device) -> tuple[Any, list[Any]]:
    from torch.distributed import pipelining as pp

    total = world * args.stages_per_rank
    if args.layers % total:
        raise SystemExit(f"--layers ({args.layers}) must be a multiple of the stages ({total})")
    stages: list[Any] = []
    for index in _stage_indices(args, rank, world):
        torch.manual_seed(args.seed + index)  # the same weights whatever runs around them
        module = StageModel(args, first=index == 0, last=index == total - 1, blocks=args.layers // total).to(device)
        stages.append(pp.PipelineStage(module, index, total, device))
    cls = getattr(pp, SCHEDULE_CLASSES[args.schedule])
    if args.schedule in SINGLE:
        return cls(stages[0], args.micro_batches, loss_fn=_loss), stages
    return cls(stages, args.micro_batches, loss_fn=_loss), stages


# --------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------


class RecvTimers:
    """Times the schedule's p2p waits (torch's ``_wait_batch_p2p``), independently of anything else."""

    def __init__(self) -> None:
        self.waits: list[tuple[int, int]] = []

    def install(self) -> None:
        from torch.distributed.pipelining import schedules

        inner = schedules._wait_batch_p2p

        def timed(work: list[Any]) -> None:
            if not work:
                return inner(work)  # type: ignore[no-any-return]
            t0 = time.monotonic_ns()
            try:
                return inner(work)  # type: ignore[no-any-return]
            finally:
                self.waits.append((t0, time.monotonic_ns() - t0))

        schedules._wait_batch_p2p = timed

    def take(self) -> list[tuple[int, int]]:
        waits, self.waits = self.waits, []
        return waits


def train(args: TrainArgs) -> None:
    """Run ``args.steps`` training steps as the rank the environment describes."""
    rank, local_rank, world = rank_env()
    device = rank_device(args, local_rank)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.distributed.init_process_group("gloo" if args.device == "cpu" else "nccl")
    schedule, stages = _build(args, rank, world, device)
    holds_first = any(s.is_first for s in stages)
    holds_last = any(s.is_last for s in stages)
    timers = RecvTimers()
    if args.recv_timers:
        timers.install()
    params = [p for s in stages for p in s.submod.parameters()]
    optimizer = torch.optim.Adam(params, lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)
    with jsonl_file(args.jsonl, rank) as out:
        times: list[float] = []
        for step in range(args.steps):
            tokens, labels = arithmetic_batch(args, gen, args.micro_batch_size * args.micro_batches)
            t0, cpu0 = time.perf_counter(), time.process_time()
            losses: list[torch.Tensor] = []
            inputs = (tokens.to(device),) if holds_first else ()
            if holds_last:
                schedule.step(*inputs, target=labels.to(device), losses=losses)
            else:
                schedule.step(*inputs)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_ms = (time.perf_counter() - t0) * 1e3
            times.append(step_ms)
            loss = float(torch.stack(losses).detach().mean()) if losses else None
            record: dict[str, Any] = {"rank": rank, "stage": rank, "step": step, "loss": loss}
            record["step_ms"] = round(step_ms, 3)
            record["cpu_ms"] = round((time.process_time() - cpu0) * 1e3, 3)
            if args.recv_timers:
                record.update(recv_fields(timers.take()))
            emit(record, out)
        emit(done_record(rank, times), out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    return run_script(train, parse_args(argv), name="torchpipe")


if __name__ == "__main__":
    sys.exit(main())
