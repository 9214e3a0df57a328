"""A small causal transformer language model, trained byte by byte in bubble-sized steps.

The model is ``nn.TransformerEncoder`` under a causal mask, between a byte
embedding (plus learned positions) and a linear head over the 256 byte values;
AdamW trains it on windows of a text. Nothing here splits the work by hand:
:class:`freeride.partition.PartitionedTraining` traces the model, opens the
encoder into its layers and their attention and feed-forward blocks as the
bubbles require, and times every piece on the device the task landed on.

The text is a generated corpus by default (sentences from a small seeded
grammar: learnable within a few hundred batches) or any file given as
``text_file``. Window ``i`` of the run is drawn from a generator seeded by
``seed`` and ``i``, so the data replays exactly after a restore.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from freeride.partition import PartitionedTraining, TrainingParts
from freeride.sidetasks._batches import TokenWindows
from freeride.sidetasks._common import sample_seed
from freeride.sidetasks._options import check_at_least, check_positive

__all__ = ["TransformerLMTraining"]

_SUBJECTS = ("the cat", "a dog", "the old sailor", "my neighbour", "the small robot", "a quiet student")
_VERBS = ("sees", "follows", "paints", "finds", "remembers", "carries")
_OBJECTS = ("a red ball", "the long river", "an open door", "the last train", "a paper boat", "the green lamp")
_ENDINGS = (".", " at night.", " in the rain.", " every morning.", " without a word.")


def generated_corpus(sentences: int, seed: int) -> bytes:
    """``sentences`` sentences of the seeded grammar, one per line."""
    g = torch.Generator().manual_seed(sample_seed(seed, 11, 0))
    lines = []
    for pick in torch.randint(0, 720, (sentences, 4), generator=g).tolist():
        s, v, o, e = (pick[0] % 6, pick[1] % 6, pick[2] % 6, pick[3] % 5)
        lines.append(f"{_SUBJECTS[s]} {_VERBS[v]} {_OBJECTS[o]}{_ENDINGS[e]}")
    return "\n".join(lines).encode()


class TinyCausalLM(nn.Module):
    """Byte embedding + learned positions, a causal ``nn.TransformerEncoder``, a final norm and the byte head."""

    def __init__(self, *, context: int, d_model: int, layers: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, d_model)
        self.pos = nn.Parameter(torch.randn(context, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, 4 * d_model, dropout=dropout, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 256)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        h = self.encoder(h, mask=self.mask, is_causal=True)
        logits: torch.Tensor = self.head(self.norm(h))
        return logits


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class TransformerLMTraining(PartitionedTraining):
    """Train a small causal transformer LM on bytes of text, with AdamW.

    Options (keyword arguments): ``batch_size`` (8), ``context`` (64 bytes),
    ``d_model`` (128), ``layers`` (4), ``heads`` (4), ``dropout`` (0.1), ``lr``
    (1e-3), ``weight_decay`` (0.01), ``seed`` (0: weights and windows),
    ``text_file`` ("": a generated corpus of ``sentences`` sentences),
    ``sentences`` (4000), and the partitioning options ``target_ms`` (the
    longest a step should take; 0: sized from the device's bubbles), ``steps`` (0: until stopped; else batches)
    and ``profile_runs`` (2).

    Metrics: ``loss`` (nats per byte, last batch), ``loss_ema``,
    ``bits_per_byte`` (smoothed), ``batches``, ``steps_per_batch``.
    """

    def __init__(
        self,
        *,
        batch_size: int = 8,
        context: int = 64,
        d_model: int = 128,
        layers: int = 4,
        heads: int = 4,
        dropout: float = 0.1,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        seed: int = 0,
        text_file: str = "",
        sentences: int = 4000,
        target_ms: float = 0.0,
        steps: int = 0,
        profile_runs: int = 2,
    ) -> None:
        super().__init__(target_ms=target_ms, steps=steps, profile_runs=profile_runs)
        check_at_least(1, batch_size=batch_size, context=context, layers=layers, heads=heads)
        if d_model < 1 or d_model % heads:
            raise ValueError(f"d_model must be a positive multiple of heads ({heads}), got {d_model}")
        if not 0 <= dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        check_positive(lr=lr)
        check_at_least(0, weight_decay=weight_decay)
        check_at_least(1, sentences=sentences)
        self.batch_size, self.context, self.d_model, self.layers, self.heads = (
            batch_size,
            context,
            d_model,
            layers,
            heads,
        )
        self.dropout, self.lr, self.weight_decay, self.seed = dropout, lr, weight_decay, seed
        self.text_file, self.sentences = text_file, sentences

    def _text(self) -> torch.Tensor:
        if self.text_file:
            raw = Path(self.text_file).expanduser().read_bytes()
        else:
            raw = generated_corpus(self.sentences, self.seed)
        if len(raw) < self.context + 2:
            raise ValueError(f"the text has {len(raw)} bytes: fewer than context + 2 ({self.context + 2})")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()

    def build(self) -> TrainingParts:
        torch.manual_seed(self.seed)
        model = TinyCausalLM(
            context=self.context, d_model=self.d_model, layers=self.layers, heads=self.heads, dropout=self.dropout
        ).to(self.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        data = TokenWindows(
            self._text()[:-1],  # the last byte is in no window: a seed's batches depend on the length
            batch_size=self.batch_size,
            context=self.context,
            seed=self.seed,
            stream=12,
            device=self.device,
        )
        return TrainingParts(model, optimizer, _loss, data)

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        out["bits_per_byte"] = self.loss_ema / math.log(2)
        return out
