"""A small GPT trained with megatron-core's pipeline schedules, on CPU (gloo) or GPU.

Every rank prints one JSON line per training step (``rank``, ``stage``, ``step``,
``loss`` (last stage only, else null), ``step_ms``, ``cpu_ms`` (the rank process's
CPU time in the step, all threads); ``recv_ms`` and ``recv`` (the
receive waits as ``[start_ns, duration_ns]`` on the monotonic clock) with
``--recv-timers``, measured by megatron's own ``config.timers`` hooks). Launch it
as any megatron job, with 1F1B or interleaved 1F1B::

    torchrun --standalone --nproc_per_node 2 tools/train/megatron_gpt.py --steps 20
    torchrun --standalone --nproc_per_node 2 tools/train/megatron_gpt.py --schedule interleaved --vpp 2
    python tools/train/megatron_gpt.py --spawn 2 --steps 20        # starts its own ranks
    python tools/train/megatron_gpt.py --spawn 1 --steps 20        # pipeline size 1: no bubbles

``--eval-every N`` runs a forward-only call (``forward_only=True``, on held-out
batches) after every N-th step and prints its record with ``"eval": true``.
``--finalize`` sets a ``finalize_model_grads_func`` that all-reduces the squared
gradient norm over the pipeline group (as gradient clipping does; the record's
``grad_norm``), so every step ends with a pipeline-wide sync; with
``--recv-timers`` the record's ``finalize`` is its ``[start_ns, duration_ns]``.

The model is plain ``nn.Module`` chunks (embedding, pre-norm blocks, head) that
carry what megatron's schedules need (``.config``, ``.model_type``,
``set_input_tensor``). On CPU each rank is pinned to one core (rank ``r`` to core
``r % nproc``), runs one thread, and megatron runs under FreeRide's CPU shim.
``--compute sleep`` swaps the blocks for ones that sleep a fixed time per
micro-batch in forward and backward, so the bubbles are deterministic.
FreeRide attaches through ``freeride launch`` or, with ``--attach``, through
its one-line ``attach()``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from _args import CommonArgs, add_common_args  # tools/train is the script's directory
from _layers import GPTSlice, arithmetic_batch
from _rank import done_record, emit, jsonl_file, rank_device, rank_env, recv_fields
from _spawn import run_script

__all__ = ["Chunk", "RecvTimers", "TrainArgs", "main", "parse_args"]

_RECV_TIMERS = (
    "forward-recv",
    "backward-recv",
    "forward-send-backward-recv",
    "backward-send-forward-recv",
    "forward-send-forward-recv",
    "backward-send-backward-recv",
    "forward-backward-send-forward-backward-recv",
)
"""Megatron timer names around p2p calls that may receive."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainArgs(CommonArgs):
    """Command-line options, validated (the shared ones in :class:`CommonArgs`).

    A step is a ``forward_backward_func`` call plus an optimizer step; on CPU
    megatron also runs under FreeRide's CPU shim; ``recv_timers`` uses megatron's
    own ``config.timers`` hooks.
    """

    schedule: str
    """``1f1b`` or ``interleaved``."""
    vpp: int
    """Model chunks per rank with ``interleaved``."""
    overlap_p2p: bool
    """``overlap_p2p_comm`` (interleaved only; implies unbatched p2p)."""
    eval_every: int
    """Run a forward-only (evaluation) call after every this many steps; 0: never."""
    finalize: bool
    """Set a ``finalize_model_grads_func`` (a gradient-norm all-reduce over the pipeline group)."""
    log_level: str
    """Level of the ``logging`` root (FreeRide's attach line is INFO)."""

    def __post_init__(self) -> None:
        # not super(): slots=True rebuilds the class, which zero-argument super() does not follow (before 3.14)
        CommonArgs.__post_init__(self)
        if self.vpp < 1:
            raise ValueError(f"vpp must be >= 1, got {self.vpp}")
        if self.schedule not in ("1f1b", "interleaved"):
            raise ValueError(f"schedule must be '1f1b' or 'interleaved', got {self.schedule!r}")
        if self.schedule == "1f1b" and (self.vpp != 1 or self.overlap_p2p):
            raise ValueError("vpp and overlap_p2p need --schedule interleaved")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")
        if self.log_level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}")


def parse_args(argv: list[str] | None = None) -> TrainArgs:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--schedule", choices=("1f1b", "interleaved"), default="1f1b")
    ap.add_argument("--vpp", type=int, default=None, help="model chunks per rank (interleaved; default 2)")
    ap.add_argument("--overlap-p2p", action="store_true")
    ap.add_argument("--eval-every", type=int, default=0, help="forward-only call after every N steps (0: none)")
    ap.add_argument("--finalize", action="store_true", help="set a finalize_model_grads_func (grad-norm all-reduce)")
    ap.add_argument("--log-level", default="WARNING", type=str.upper)
    ns = ap.parse_args(argv)
    if ns.vpp is None:
        ns.vpp = 2 if ns.schedule == "interleaved" else 1
    try:
        return TrainArgs(**vars(ns))
    except ValueError as exc:
        ap.error(str(exc))


# --------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------


class Chunk(GPTSlice):
    """One virtual pipeline stage, in the form megatron's schedules drive.

    The first virtual stage embeds tokens, the last one ends in the LM head;
    between stages activations travel as ``[seq, batch, hidden]`` (megatron's
    layout).
    """

    def __init__(self, args: TrainArgs, config: Any, *, first: bool, last: bool, blocks: int) -> None:
        from megatron.core.enums import ModelType

        super().__init__(args, first=first, last=last, blocks=blocks)
        self.config = config
        self.model_type = ModelType.encoder_or_decoder
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensors: list[torch.Tensor | None] | torch.Tensor | None) -> None:
        self.input_tensor = tensors[0] if isinstance(tensors, list) else tensors

    def forward(self, tokens: torch.Tensor | None) -> torch.Tensor:
        if self.first:
            assert tokens is not None
            x = self.embed(tokens)
        else:
            assert self.input_tensor is not None
            x = self.input_tensor.transpose(0, 1)
        x = self.blocks(x)
        assert isinstance(x, torch.Tensor)
        if self.last:
            return self.logits(x)
        return x.transpose(0, 1).contiguous()


def _loss(labels: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return loss, {"loss": loss.detach().clone()}  # megatron divides the loss in place


def _forward_step(data: Iterator[tuple[torch.Tensor, torch.Tensor]], model: Chunk) -> tuple[torch.Tensor, Any]:
    tokens, labels = next(data)
    return model(tokens if model.first else None), partial(_loss, labels)


def _batches(
    args: TrainArgs, device: torch.device, *, seed: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Arithmetic token sequences (start, stride drawn per sample): learnable next-token data.

    Each model chunk draws from its own copy of the same stream, so the first
    virtual stage's inputs and the last one's labels belong together.
    """
    gen = torch.Generator().manual_seed(args.seed if seed is None else seed)
    while True:
        tokens, labels = arithmetic_batch(args, gen, args.micro_batch_size)
        yield tokens.to(device), labels.to(device)


# --------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------


class RecvTimers:
    """A ``config.timers`` for megatron that records the p2p calls that may receive."""

    def __init__(self) -> None:
        self.waits: list[tuple[int, int]] = []
        self._open: dict[str, int] = {}

    def __call__(self, name: str, log_level: int | None = None) -> _Timer:
        return _Timer(self, name)

    def take(self) -> list[tuple[int, int]]:
        waits, self.waits = self.waits, []
        return waits


class _Timer:
    def __init__(self, owner: RecvTimers, name: str) -> None:
        self._owner, self._name = owner, name

    def start(self, barrier: bool = False) -> None:
        if self._name in _RECV_TIMERS:
            self._owner._open[self._name] = time.monotonic_ns()

    def stop(self, barrier: bool = False) -> None:
        t0 = self._owner._open.pop(self._name, None)
        if t0 is not None:
            self._owner.waits.append((t0, time.monotonic_ns() - t0))


class GradNormFinalize:
    """A ``finalize_model_grads_func``: the squared gradient norm, all-reduced over the pipeline group.

    What megatron's gradient clipping computes at the end of a step; training
    does not use it (the record reports it), so losses are those of a run
    without it. ``timed`` keeps each call's ``(start_ns, duration_ns)``.
    """

    def __init__(self, model: list[Chunk]) -> None:
        self._params = [p for chunk in model for p in chunk.parameters()]
        self.norm: float | None = None
        self.timed: list[tuple[int, int]] = []

    def __call__(self, model: Any, num_tokens: Any = None, **kwargs: Any) -> None:
        from megatron.core import parallel_state

        t0 = time.monotonic_ns()
        grads = [p.grad.detach().float().pow(2).sum() for p in self._params if p.grad is not None]
        total = torch.stack(grads).sum() if grads else torch.zeros(())
        torch.distributed.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        self.norm = float(total.sqrt())
        self.timed.append((t0, time.monotonic_ns() - t0))


def _build(args: TrainArgs, world: int, stage: int, device: torch.device) -> tuple[list[Chunk], Any]:
    from megatron.core.transformer.transformer_config import TransformerConfig

    chunks = args.vpp if args.schedule == "interleaved" else 1
    virtual = world * chunks
    if args.layers % virtual:
        raise SystemExit(f"--layers ({args.layers}) must be a multiple of ranks x chunks ({virtual})")
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=world,
        virtual_pipeline_model_parallel_size=chunks if args.schedule == "interleaved" else None,
        overlap_p2p_comm=args.overlap_p2p,
        batch_p2p_comm=not args.overlap_p2p,
    )
    model: list[Chunk] = []
    for c in range(chunks):
        v = c * world + stage
        torch.manual_seed(args.seed + v)  # the same weights whatever runs around them
        chunk = Chunk(args, config, first=v == 0, last=v == virtual - 1, blocks=args.layers // virtual)
        model.append(chunk.to(device))
    return model, config


def train(args: TrainArgs) -> None:
    """Run ``args.steps`` training steps as the rank the environment describes."""
    rank, local_rank, world = rank_env()
    device = rank_device(args, local_rank)
    logging.basicConfig(level=args.log_level)
    torch.distributed.init_process_group("gloo" if args.device == "cpu" else "nccl")
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if args.attach:
        from freeride.backends.megatron import attach

        attach()
    if args.device == "cpu":
        from freeride.backends.megatron import cpu_shim

        cpu_shim.activate()
    interleaved = args.schedule == "interleaved"
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=world,
        virtual_pipeline_model_parallel_size=args.vpp if interleaved else None,
    )
    stage = parallel_state.get_pipeline_model_parallel_rank()
    model, config = _build(args, world, stage, device)
    timers = RecvTimers()
    if args.recv_timers:
        config.timers = timers
    finalize = GradNormFinalize(model) if args.finalize else None
    if finalize is not None:
        config.finalize_model_grads_func = finalize
    params = [p for chunk in model for p in chunk.parameters()]
    optimizer = torch.optim.Adam(params, lr=args.lr)
    forward_backward = get_forward_backward_func()
    data = [_batches(args, device) for _ in model]
    held_out = [_batches(args, device, seed=args.seed + 1) for _ in model]
    with jsonl_file(args.jsonl, rank) as out:
        times: list[float] = []
        for step in range(args.steps):
            t0, cpu0 = time.perf_counter(), time.process_time()
            losses = _run_schedule(args, forward_backward, model, data)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_ms = (time.perf_counter() - t0) * 1e3
            cpu_ms = (time.process_time() - cpu0) * 1e3
            times.append(step_ms)
            loss = _mean_loss(losses)
            record: dict[str, Any] = {"rank": rank, "stage": stage, "step": step, "loss": loss}
            record["step_ms"] = round(step_ms, 3)
            record["cpu_ms"] = round(cpu_ms, 3)
            if finalize is not None:
                record["grad_norm"] = finalize.norm
            if args.recv_timers:
                record.update(recv_fields(timers.take()))
                if finalize is not None:
                    record["finalize"] = finalize.timed[-1]
            emit(record, out)
            if args.eval_every and (step + 1) % args.eval_every == 0:
                emit(_evaluate(args, forward_backward, model, held_out, timers, rank, stage, step), out)
        done = done_record(rank, times)
        adapter = sys.modules.get("freeride.backends.megatron.adapter")
        if adapter is not None:  # attached: how it went
            done["freeride"] = adapter.current_adapter().stats()
        emit(done, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _run_schedule(
    args: TrainArgs,
    forward_backward: Any,
    model: list[Chunk],
    data: list[Iterator[tuple[torch.Tensor, torch.Tensor]]],
    **flags: bool,
) -> list[dict[str, torch.Tensor]]:
    """One ``forward_backward_func`` call over ``args.micro_batches`` (``flags``: its own, such as
    ``forward_only``); each micro-batch's reduced loss (last stage only, else none)."""
    interleaved = args.schedule == "interleaved"
    losses: list[dict[str, torch.Tensor]] = forward_backward(
        forward_step_func=_forward_step,
        data_iterator=data if interleaved else data[0],
        model=model if interleaved else model[0],
        num_microbatches=args.micro_batches,
        seq_length=args.seq,
        micro_batch_size=args.micro_batch_size,
        **flags,
    )
    return losses


def _mean_loss(losses: list[dict[str, torch.Tensor]]) -> float | None:
    return float(torch.stack([x["loss"] for x in losses]).mean()) if losses else None


def _evaluate(
    args: TrainArgs,
    forward_backward: Any,
    model: list[Chunk],
    data: list[Iterator[tuple[torch.Tensor, torch.Tensor]]],
    timers: RecvTimers,
    rank: int,
    stage: int,
    step: int,
) -> dict[str, Any]:
    """One forward-only call on held-out batches (as megatron's ``evaluate``): its record."""
    t0 = time.perf_counter()
    with torch.no_grad():
        losses = _run_schedule(args, forward_backward, model, data, forward_only=True)
    loss = _mean_loss(losses)
    record: dict[str, Any] = {"rank": rank, "stage": stage, "step": step, "eval": True, "loss": loss}
    record["step_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    if args.recv_timers:
        record["recv"] = timers.take()
    return record


def main(argv: list[str] | None = None) -> int:
    return run_script(train, parse_args(argv), name="megatron")


if __name__ == "__main__":
    sys.exit(main())
