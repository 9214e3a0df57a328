"""The options both training scripts share: one dataclass and one set of flags.

Each script's ``TrainArgs`` extends :class:`CommonArgs` with its framework's
options (DeepSpeed: stages, gradient clipping; megatron: schedule, virtual
stages, p2p overlap) and its parser adds them after :func:`add_common_args`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

__all__ = ["CommonArgs", "add_common_args"]


@dataclass(frozen=True, kw_only=True, slots=True)
class CommonArgs:
    """Command-line options of both training scripts, validated."""

    steps: int
    """Training steps (optimizer steps)."""
    micro_batches: int
    """Micro-batches per step (gradient accumulation steps)."""
    micro_batch_size: int
    layers: int
    """Transformer blocks, split evenly over the pipeline's (virtual) stages."""
    hidden: int
    heads: int
    seq: int
    vocab: int
    compute: str
    """``matmul`` (real math) or ``sleep``."""
    sleep_forward_ms: float
    """Per block and micro-batch, in sleep mode."""
    sleep_backward_ms: float
    seed: int
    lr: float
    device: str
    """``cpu`` (gloo, one pinned core per rank) or ``cuda`` (nccl)."""
    recv_timers: bool
    """Time, per step, the waits in the pipeline's receives (``recv_ms``), measured by the
    script itself, independently of FreeRide (each script's docstring says how)."""
    jsonl: str
    """Also append the JSON lines to this file; ``{rank}`` is replaced by the rank."""
    spawn: int
    """Start this many ranks here instead of being started by a launcher."""
    attach: bool
    """Attach FreeRide with its one-line ``attach()`` instead of relying on ``freeride launch``."""

    def __post_init__(self) -> None:
        for name in ("steps", "micro_batches", "micro_batch_size", "layers", "hidden", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("seq", "vocab"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.compute not in ("matmul", "sleep"):
            raise ValueError(f"compute must be 'matmul' or 'sleep', got {self.compute!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.sleep_forward_ms < 0 or self.sleep_backward_ms < 0:
            raise ValueError("sleep_forward_ms and sleep_backward_ms must be >= 0")
        if self.spawn < 0:
            raise ValueError(f"spawn must be >= 0, got {self.spawn}")


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """Add the flags of :class:`CommonArgs`, with the defaults both scripts use."""
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--compute", choices=("matmul", "sleep"), default="matmul")
    ap.add_argument("--sleep-forward-ms", type=float, default=5.0)
    ap.add_argument("--sleep-backward-ms", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--recv-timers", action="store_true")
    ap.add_argument("--jsonl", default="")
    ap.add_argument("--spawn", type=int, default=0)
    ap.add_argument("--attach", action="store_true")
