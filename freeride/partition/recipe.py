"""What a training recipe adds to the plain step: a learning-rate schedule, gradient clipping, mixed precision.

Each is the plain loop's own call, made where the plain loop makes it:

* the scheduler's ``step()`` once per batch, after the batch's last update
  chunk (never while setup times the update);
* ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` once per
  batch, when the backward pass is complete and before the first update
  chunk, so the norm is that of the whole batch's gradient;
* ``torch.autocast(device_type, dtype)`` around each forward piece (the loss
  included); the backward pass runs outside it, as in the plain loop.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

__all__ = ["Recipe"]


class Recipe:
    """A partitioned training task's scheduler, clipping and autocast, as options resolved at setup.

    Args:
        clip_grad_norm: The most the total gradient norm may be (0: no clipping).
        autocast_dtype: The dtype forward pieces run in under ``torch.autocast`` (None: off).
    """

    def __init__(self, *, clip_grad_norm: float = 0.0, autocast_dtype: torch.dtype | None = None) -> None:
        if not (clip_grad_norm >= 0 and math.isfinite(clip_grad_norm)):
            raise ValueError(f"clip_grad_norm must be a finite norm >= 0 (0: no clipping), got {clip_grad_norm}")
        if autocast_dtype is not None and not autocast_dtype.is_floating_point:
            raise ValueError(f"autocast_dtype must be a floating-point dtype (or None), got {autocast_dtype}")
        self.clip_grad_norm = clip_grad_norm
        self.autocast_dtype = autocast_dtype
        self.scheduler: LRScheduler | None = None
        self.grad_norm = math.nan
        """The last batch's total gradient norm before clipping (NaN without clipping)."""

    def attach(self, scheduler: LRScheduler | None, optimizer: torch.optim.Optimizer) -> None:
        """Take the scheduler :meth:`PartitionedTraining.build` returned (it must drive ``optimizer``).

        Raises:
            ValueError: For a scheduler of another optimizer, or one stepped with a metric.
        """
        if scheduler is not None:
            if isinstance(scheduler, ReduceLROnPlateau):
                raise ValueError(
                    "ReduceLROnPlateau steps on a metric; a partitioned task steps its scheduler once per batch"
                    " with no argument (give a scheduler such as StepLR, CosineAnnealingLR or LambdaLR)"
                )
            if scheduler.optimizer is not optimizer:
                raise ValueError("the scheduler build() returned drives another optimizer than the one it returned")
        self.scheduler = scheduler

    def forward(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """The context forward pieces (and the loss) run in: ``torch.autocast``, or nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)

    def clip(self, model: nn.Module) -> None:
        """Clip the batch's complete gradient by its total norm, as the plain loop would (if clipping is on)."""
        if self.clip_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip_grad_norm)
            self.grad_norm = float(norm)

    def end_batch(self) -> None:
        """After the batch's update: step the scheduler once."""
        if self.scheduler is not None:
            self.scheduler.step()

    @property
    def lr(self) -> float:
        """The first parameter group's learning rate now (NaN without a scheduler)."""
        return float(self.scheduler.get_last_lr()[0]) if self.scheduler is not None else math.nan

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's state (None without one)."""
        return {"scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` returned (a checkpoint without it leaves the scheduler as built)."""
        saved = state.get("scheduler")
        if self.scheduler is not None and saved is not None:
            self.scheduler.load_state_dict(saved)
