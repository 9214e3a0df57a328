"""Model parts and data the training scripts share: a GPT block, a block that sleeps instead of computing,
a slice of the GPT for one pipeline stage, and learnable token sequences."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from _args import CommonArgs  # tools/train is the scripts' directory
from torch import nn

__all__ = ["Block", "GPTSlice", "SleepBlock", "arithmetic_batch"]


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
    """Identity that sleeps: stands in for device kernels of a fixed length.

    It returns a view of its input, or with ``copy`` a copy: zero-bubble schedules detach
    the input-gradient graph in place, which a view does not allow.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float, copy: bool) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone() if copy else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None, None


_sleep: Callable[[torch.Tensor, float, float, bool], torch.Tensor] = _Sleep.apply


class SleepBlock(nn.Module):
    """A residual linear layer whose forward and backward (input gradient) take a fixed time.

    ``copy``: its output is a copy of the sleeping identity's input rather than a view (see ``_Sleep``).
    """

    def __init__(self, hidden: int, forward_ms: float, backward_ms: float, *, copy: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)
        self.forward_s = forward_ms / 1e3
        self.backward_s = backward_ms / 1e3
        self.copy = copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _sleep(x + self.lin(x), self.forward_s, self.backward_s, self.copy)


class GPTSlice(nn.Module):
    """The layers of one pipeline stage: the embeddings if ``first``, ``blocks`` blocks, the LM head if ``last``.

    The blocks are :class:`SleepBlock` with ``--compute sleep`` (``copy`` as it says), else :class:`Block`.
    Each script's stage module extends it with the ``forward`` its schedules call.
    """

    def __init__(self, args: CommonArgs, *, first: bool, last: bool, blocks: int, copy: bool = False) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok = nn.Embedding(args.vocab, args.hidden)
            self.pos = nn.Embedding(args.seq, args.hidden)
        layers: list[nn.Module] = []
        for _ in range(blocks):
            if args.compute == "sleep":
                layers.append(SleepBlock(args.hidden, args.sleep_forward_ms, args.sleep_backward_ms, copy=copy))
            else:
                layers.append(Block(args.hidden, args.heads))
        self.blocks = nn.Sequential(*layers)
        if last:
            self.ln = nn.LayerNorm(args.hidden)
            self.head = nn.Linear(args.hidden, args.vocab)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token plus learned position embedding (first stage only)."""
        out: torch.Tensor = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        return out

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head (last stage only)."""
        out: torch.Tensor = self.head(self.ln(x))
        return out


def arithmetic_batch(args: CommonArgs, gen: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` arithmetic token sequences (start, stride drawn per sample): learnable next-token data.

    Returns:
        The tokens and their labels (the same sequences one token on), ``[n, seq]`` each.
    """
    steps = torch.arange(args.seq + 1)
    start = torch.randint(0, args.vocab, (n, 1), generator=gen)
    stride = torch.randint(1, 8, (n, 1), generator=gen)
    seqs = (start + stride * steps) % args.vocab
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
