"""Training data of the partitioned sample tasks: re-iterables whose batch ``i`` is a function of ``i`` alone.

Each has ``iter_from(i)``, so a restored task starts at its batch without
replaying the ones before.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from freeride.sidetasks._common import ShuffledCursor, sample_seed
from freeride.sidetasks._data import LabelledImages

__all__ = ["ShuffledBatches", "TokenWindows"]


class ShuffledBatches:
    """Batches of a labelled image set in a fresh seeded order each epoch, moved to ``device``."""

    def __init__(self, images: LabelledImages, *, batch_size: int, seed: int, device: torch.device) -> None:
        self.images, self.batch_size, self.seed, self.device = images, batch_size, seed, device

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.iter_from(0)

    def iter_from(self, i: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches from batch ``i`` on."""
        cursor = ShuffledCursor(len(self.images), seed=self.seed)
        cursor.position = i * self.batch_size
        while True:
            x, y = self.images.batch(cursor.take(self.batch_size))
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


class TokenWindows:
    """Seeded random windows of ``context + 1`` tokens as ``(x, y)`` batches, ``y`` shifted by one.

    Every window lies inside ``tokens`` (at least ``context + 1`` of them);
    ``stream`` tells apart the draws of tasks that share a ``seed``.
    """

    def __init__(
        self, tokens: torch.Tensor, *, batch_size: int, context: int, seed: int, stream: int, device: torch.device
    ) -> None:
        self.tokens, self.batch_size, self.context, self.device = tokens, batch_size, context, device
        self.seed, self.stream = seed, stream

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.iter_from(0)

    def iter_from(self, i: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches from batch ``i`` on."""
        offsets = torch.arange(self.context + 1)
        while True:
            g = torch.Generator().manual_seed(sample_seed(self.seed, self.stream, i))
            starts = torch.randint(0, len(self.tokens) - self.context, (self.batch_size, 1), generator=g)
            chunk = self.tokens[starts + offsets].to(self.device)
            yield chunk[:, :-1], chunk[:, 1:]
            i += 1
