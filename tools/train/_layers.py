"""Model parts both CPU training scripts use: a GPT block and a block that sleeps instead of computing."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "SleepBlock"]


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP on ``[batch, seq, hidden]``."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (y.view(b, t, self.heads, h // self.heads).transpose(1, 2) for y in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, h))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class _Sleep(torch.autograd.Function):
    """Identity that sleeps: stands in for device kernels of a fixed length."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


_sleep: Callable[[torch.Tensor, float, float], torch.Tensor] = _Sleep.apply


class SleepBlock(nn.Module):
    """A residual linear layer whose forward and backward take a fixed time."""

    def __init__(self, hidden: int, forward_ms: float, backward_ms: float) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)
        self.forward_s = forward_ms / 1e3
        self.backward_s = backward_ms / 1e3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _sleep(x + self.lin(x), self.forward_s, self.backward_s)
