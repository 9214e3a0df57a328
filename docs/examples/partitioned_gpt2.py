"""A small GPT-2 built from its config (random weights, nothing downloaded) trained as a side task in pieces.

Run it alone: ``python docs/examples/partitioned_gpt2.py``; submit it with
``freeride submit docs/examples/partitioned_gpt2.py:TinyGPT2Training``. It needs ``transformers``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from freeride.partition import PartitionedTraining, TrainingParts
from freeride.sidetask import run_alone


def next_token_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """The model's output arrives as it returns it: a ModelOutput, with its logits."""
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


VOCAB, SEQ = 64, 16


class TinyGPT2Training(PartitionedTraining):
    """A Hugging Face model as it is: the partitioner exports it with torch.export and cuts it in pieces."""

    def build(self) -> TrainingParts:
        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ)
        model = GPT2LMHeadModel(config).to(self.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        # counting sequences from random starts: the next token is the last one plus 1
        g = torch.Generator().manual_seed(1)
        starts = torch.randint(0, VOCAB, (8, 4, 1), generator=g)
        tokens = (starts + torch.arange(SEQ + 1)) % VOCAB
        data = [(t[:, :-1], t[:, 1:]) for t in tokens]  # batches of one shape: the exported graph's
        return TrainingParts(model, optimizer, next_token_loss, data)


async def main() -> None:
    task = TinyGPT2Training(steps=12)
    await run_alone(task, steps=100_000)
    print(f"{task.batches_done} batches; loss {task.loss:.3f} (ln {VOCAB} = 4.16 at random)")


if __name__ == "__main__":
    asyncio.run(main())
