"""Labelled image sets for the vision side tasks: synthetic, or a folder of files.

Neither touches the network. Both are indexable (sample ``i`` is always the
same image), so a task's place in its data is one integer that a checkpoint
can hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from freeride.sidetasks._common import sample_seed
from freeride.sidetasks._imageio import list_images, read_image

__all__ = ["ImageFolder", "LabelledImages", "SyntheticImages"]


class LabelledImages(Protocol):
    """An indexable labelled image set."""

    @property
    def num_classes(self) -> int: ...

    def __len__(self) -> int: ...

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Images ``(N, 3, S, S)`` float32 and labels ``(N,)`` int64 for ``indices``, on the CPU."""
        ...


class SyntheticImages:
    """Noisy, shifted copies of one smooth random pattern per class.

    Each class has a prototype: a 4x4 grid of random colours upsampled
    bilinearly to ``image_size`` and standardised. Sample ``i`` of ``split`` is
    its class prototype, circularly shifted by up to ``image_size // 8``
    pixels, scaled by a random contrast in ``[0.6, 1.4]``, plus Gaussian noise
    of standard deviation ``noise``. The label is random per sample. The
    prototypes depend only on ``seed``, so train and eval splits share classes
    and a model fitted on one scores on the other.
    """

    def __init__(self, *, num_classes: int, image_size: int, size: int, seed: int, split: int, noise: float = 1.0):
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._num_classes = num_classes
        self.image_size = image_size
        self.size = size
        self.seed = seed
        self.split = split
        self.noise = noise
        g = torch.Generator().manual_seed(sample_seed(seed, -1, 0))
        grid = torch.randn(num_classes, 3, 4, 4, generator=g)
        proto = F.interpolate(grid, size=(image_size, image_size), mode="bilinear", align_corners=False)
        mean = proto.mean(dim=(1, 2, 3), keepdim=True)
        std = proto.std(dim=(1, 2, 3), keepdim=True)
        self.prototypes = (proto - mean) / std

    @property
    def num_classes(self) -> int:
        return self._num_classes

    def __len__(self) -> int:
        return self.size

    def sample(self, index: int) -> tuple[torch.Tensor, int]:
        """Image ``(3, S, S)`` and label of sample ``index``."""
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} out of range [0, {self.size})")
        g = torch.Generator().manual_seed(sample_seed(self.seed, self.split, index))
        label = int(torch.randint(self._num_classes, (1,), generator=g))
        reach = self.image_size // 8
        dy, dx = (int(v) for v in torch.randint(-reach, reach + 1, (2,), generator=g))
        contrast = 0.6 + 0.8 * float(torch.rand((), generator=g))
        img = torch.roll(self.prototypes[label], shifts=(dy, dx), dims=(1, 2)) * contrast
        img = img + self.noise * torch.randn(img.shape, generator=g)
        return img, label

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        items = [self.sample(i) for i in indices]
        return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items], dtype=torch.int64)


class ImageFolder:
    """A folder with one sub-folder of images per class, as torchvision's ImageFolder.

    Classes are the sub-folder names in sorted order. Every ``holdout_every``-th
    file of a class (in name order) belongs to the eval split (``split=1``),
    the rest to the train split (``split=0``). Images are decoded on access,
    made 3-channel, resized to ``image_size`` squared and normalised to about
    zero mean and unit spread.
    """

    def __init__(self, root: Path, *, image_size: int, split: int, holdout_every: int = 10) -> None:
        if not root.is_dir():
            raise ValueError(f"data_dir {str(root)!r} is not a directory")
        if holdout_every < 2:
            raise ValueError(f"holdout_every must be >= 2, got {holdout_every}")
        self.classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        if len(self.classes) < 2:
            raise ValueError(f"data_dir {str(root)!r} needs at least two class sub-folders")
        self.image_size = image_size
        self.items: list[tuple[Path, int]] = []
        for label, name in enumerate(self.classes):
            files = list_images(root / name)
            keep = [f for k, f in enumerate(files) if (k % holdout_every == 0) == (split == 1)]
            self.items += [(f, label) for f in keep]
        if not self.items:
            raise ValueError(f"data_dir {str(root)!r} has no readable images for split {split}")

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def __len__(self) -> int:
        return len(self.items)

    def load(self, index: int) -> tuple[torch.Tensor, int]:
        """Decoded, resized and normalised image ``(3, S, S)`` and label of item ``index``."""
        path, label = self.items[index]
        img = read_image(path)
        if img.shape[0] == 1:
            img = img.expand(3, -1, -1)
        size = (self.image_size, self.image_size)
        if tuple(img.shape[1:]) != size:
            img = F.interpolate(img.unsqueeze(0), size=size, mode="bilinear", antialias=True, align_corners=False)[0]
        return (img - 0.5) / 0.25, label

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        items = [self.load(i) for i in indices]
        return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items], dtype=torch.int64)
