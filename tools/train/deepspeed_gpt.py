"""A small GPT trained with DeepSpeed pipeline parallelism, on CPU (gloo) or GPU.

Every rank prints one JSON line per training step (``rank``, ``stage``, ``step``,
``loss``, ``step_ms``, ``cpu_ms`` (the rank process's CPU time in the step, all
threads); ``recv_ms`` with ``--recv-timers``). Launch it as any
DeepSpeed pipeline job::

    torchrun --standalone --nproc_per_node 2 tools/train/deepspeed_gpt.py --steps 20
    deepspeed --num_gpus 2 tools/train/deepspeed_gpt.py --steps 20
    python tools/train/deepspeed_gpt.py --spawn 2 --steps 20        # starts its own ranks
    python tools/train/deepspeed_gpt.py --spawn 2 --schedule dualpipev --micro-batches 8

``--schedule dualpipev`` builds a ``DualPipeVModule`` (DeepSpeed picks its
``DualPipeVEngine`` and ``DualPipeVSchedule`` from the module's type): every rank
holds two stages of a V, rank 0 both the embedding and the loss; it needs
``--layers`` a multiple of ``2 * --stages`` and ``--micro-batches >= 2 * --stages``.
Its p2p goes through ``batch_isend_irecv``, committed by ``CommitP2P``;
``--recv-timers`` then also reports the time spent there (``p2p_ms``).

On CPU each rank is pinned to one core (rank ``r`` to core ``r % nproc``) and runs
one thread, so a core plays a device. ``--compute sleep`` swaps the transformer
blocks for ones that sleep a fixed time per micro-batch in forward and backward:
the pipeline's bubbles are then deterministic, for tests.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from _args import CommonArgs, add_common_args  # tools/train is the script's directory
from _layers import Block, SleepBlock, arithmetic_batch
from _rank import done_record, emit, jsonl_file, pin_cpu, rank_env
from _spawn import run_script
from torch import nn

__all__ = ["Block", "Embed", "Head", "SleepBlock", "TrainArgs", "main", "parse_args"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainArgs(CommonArgs):
    """Command-line options, validated (the shared ones in :class:`CommonArgs`).

    ``recv_timers`` times DeepSpeed's p2p receives (``recv_ms``), sends (``send_ms``)
    and all-reduces (``allreduce_ms``); ``attach`` calls ``freeride.backends.deepspeed.attach``.
    """

    stages: int
    """Pipeline stages; the world size must be a multiple."""
    gradient_clipping: float
    schedule: str = "1f1b"
    """``1f1b`` (DeepSpeed's ``TrainSchedule``) or ``dualpipev`` (two stages per rank in a V)."""
    shm_op: bool = True
    """Let DeepSpeed build its shared-memory all-reduce op on CPU (a C++ build of 1-2 minutes, once per
    machine and install); without it gloo's all-reduce serves, as on a platform the op does not support."""

    def __post_init__(self) -> None:
        # not super(): slots=True rebuilds the class, which zero-argument super() does not follow (before 3.14)
        CommonArgs.__post_init__(self)
        if self.stages < 1:
            raise ValueError(f"stages must be >= 1, got {self.stages}")
        if self.schedule not in ("1f1b", "dualpipev"):
            raise ValueError(f"schedule must be '1f1b' or 'dualpipev', got {self.schedule!r}")
        parts = 2 * self.stages if self.schedule == "dualpipev" else self.stages
        if self.layers % parts:
            what = "2 * stages" if self.schedule == "dualpipev" else "stages"
            raise ValueError(f"layers ({self.layers}) must be a multiple of {what} ({parts})")
        if self.schedule == "dualpipev" and self.micro_batches < 2 * self.stages:
            raise ValueError(
                f"micro_batches ({self.micro_batches}) must be >= 2 * stages ({2 * self.stages}) for dualpipev"
            )


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--gradient-clipping", type=float, default=1.0)
    ap.add_argument("--schedule", choices=("1f1b", "dualpipev"), default="1f1b")
    ap.add_argument(
        "--no-shm-op",
        dest="shm_op",
        action="store_false",
        help="on CPU, skip the build of DeepSpeed's shared-memory all-reduce op (gloo's serves)",
    )
    ap.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # `deepspeed` passes it
    ns = ap.parse_args(argv)
    values = {k: v for k, v in vars(ns).items() if k != "local_rank"}
    try:
        return TrainArgs(**values)
    except ValueError as exc:
        ap.error(str(exc))


# --------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------


class Embed(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, vocab: int, hidden: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq, hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        out: torch.Tensor = self.tok(tokens) + self.pos(positions)
        return out


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.out(self.ln(x))
        return logits


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _batches(args: TrainArgs) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Arithmetic token sequences (start, stride drawn per sample): learnable next-token data.

    Every rank draws the same stream, so the first stage's inputs and the last
    stage's labels belong together.
    """
    gen = torch.Generator().manual_seed(args.seed)
    while True:
        yield arithmetic_batch(args, gen, args.micro_batch_size)


# --------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------


def _seed_layer(seed: Any) -> None:
    # DeepSpeed's default seeds `random` too, which rejects the numpy ints its balanced partitioning yields.
    torch.manual_seed(int(seed))


class _CommClock:
    """Sums the time spent in ``p2p.recv``, ``p2p.send`` and ``deepspeed.comm.all_reduce``.

    A test instrument: it wraps the module functions DeepSpeed's pipeline engine calls
    (``wall_clock_breakdown`` cannot serve here: in DeepSpeed 0.19.8 it trips an assertion
    in pipeline training). Under DualPipeV it also sums ``p2p_ms``: the time in
    ``deepspeed.comm.batch_isend_irecv`` and in waiting for the requests it returns
    (what ``CommitP2P`` does).
    """

    def __init__(self, *, batched: bool = False) -> None:
        import deepspeed.comm
        from deepspeed.runtime.pipe import p2p

        self.totals = {"recv_ms": 0.0, "send_ms": 0.0, "allreduce_ms": 0.0}
        p2p.recv = self._timed("recv_ms", p2p.recv)
        p2p.send = self._timed("send_ms", p2p.send)
        deepspeed.comm.all_reduce = self._timed("allreduce_ms", deepspeed.comm.all_reduce)
        if batched:
            self.totals["p2p_ms"] = 0.0
            launch = self._timed("p2p_ms", deepspeed.comm.batch_isend_irecv)

            def batch_isend_irecv(*args: Any, **kwargs: Any) -> list[_TimedWork]:
                return [_TimedWork(work, self) for work in launch(*args, **kwargs)]

            deepspeed.comm.batch_isend_irecv = batch_isend_irecv

    def _timed(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] += (time.perf_counter() - t0) * 1e3

        return timed

    def take(self) -> dict[str, float]:
        """The totals since the last call, in ms."""
        out = {k: round(v, 3) for k, v in self.totals.items()}
        self.totals = dict.fromkeys(self.totals, 0.0)
        return out


class _TimedWork:
    """A request of ``batch_isend_irecv`` whose ``wait`` counts towards ``p2p_ms``."""

    def __init__(self, work: Any, clock: _CommClock) -> None:
        self._work = work
        self._clock = clock

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._clock.totals["p2p_ms"] += (time.perf_counter() - t0) * 1e3

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def train(args: TrainArgs) -> None:
    """Run ``args.steps`` training steps as the rank the environment describes."""
    rank, local_rank, _ = rank_env()
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        pin_cpu(local_rank)
    import deepspeed
    from deepspeed.pipe import DualPipeVModule, LayerSpec, PipelineModule

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if not args.shm_op:
        import deepspeed.ops

        # the one switch DeepSpeed reads before it builds the op (its compatibility table, probed once)
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo" if args.device == "cpu" else "nccl")
    torch.manual_seed(args.seed)
    if args.compute == "sleep":
        blocks = [
            LayerSpec(SleepBlock, args.hidden, args.sleep_forward_ms, args.sleep_backward_ms)
            for _ in range(args.layers)
        ]
    else:
        blocks = [LayerSpec(Block, args.hidden, args.heads) for _ in range(args.layers)]
    module = DualPipeVModule if args.schedule == "dualpipev" else PipelineModule
    model = module(
        layers=[LayerSpec(Embed, args.vocab, args.hidden, args.seq), *blocks, LayerSpec(Head, args.hidden, args.vocab)],
        num_stages=args.stages,
        loss_fn=_loss,
        partition_method="type:Block",
        seed_layers=True,
        base_seed=args.seed,
        seed_fn=_seed_layer,
    )
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch_size,
        "gradient_accumulation_steps": args.micro_batches,
        "optimizer": {"type": "Adam", "params": {"lr": args.lr, "torch_adam": True}},
        "gradient_clipping": args.gradient_clipping,
        "steps_per_print": 10**9,
    }
    clock = _CommClock(batched=args.schedule == "dualpipev") if args.recv_timers else None
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    handle = None
    if args.attach:
        import freeride.backends.deepspeed

        handle = freeride.backends.deepspeed.attach(engine)
    data = _batches(args)
    try:
        with jsonl_file(args.jsonl, rank) as out:
            times: list[float] = []
            for step in range(args.steps):
                t0, cpu0 = time.perf_counter(), time.process_time_ns()
                loss = engine.train_batch(data_iter=data)
                step_ms = (time.perf_counter() - t0) * 1e3
                cpu_ms = (time.process_time_ns() - cpu0) / 1e6
                times.append(step_ms)
                record: dict[str, Any] = {
                    "rank": rank,
                    "stage": int(engine.stage_id),
                    "step": step,
                    "loss": float(loss),
                    "step_ms": round(step_ms, 3),
                    "cpu_ms": round(cpu_ms, 3),
                }
                if clock is not None:
                    record.update(clock.take())
                emit(record, out)
            emit(done_record(rank, times), out)
    finally:
        if handle is not None:
            handle.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    return run_script(train, parse_args(argv), name="deepspeed")


if __name__ == "__main__":
    sys.exit(main())
