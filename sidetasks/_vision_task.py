"""The model, data and whole-batch SGD step of the vision inference tasks, and their checkpoint state."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from freeride.partition import capture_rng, restore_rng
from freeride.sidetask import TaskContext
from freeride.sidetasks._common import DeviceTask, ShuffledCursor, check_fingerprint
from freeride.sidetasks._cost import UPDATE_COST_PER_ELEMENT, backward_cost, segment_costs
from freeride.sidetasks._vision_options import VisionOptions

__all__ = ["VisionTask"]

logger = logging.getLogger("freeride.sidetasks.vision")  # logged under the module the tasks are named by

_EMA = 0.9


class VisionTask(VisionOptions, DeviceTask):
    """Model, data and the whole-batch SGD step of the inference tasks (their ``fit_steps``)."""

    def __init__(self, *, steps: int, layer_steps: bool) -> None:
        """Set up the fitting state; call it after :meth:`_check_options`, which sets the options and data."""
        super().__init__()
        self.steps, self.layer_steps = steps, bool(layer_steps)
        self.cursor = ShuffledCursor(len(self.train), seed=self.seed)
        self.done_steps = 0
        self.loss = math.nan
        self.loss_ema = math.nan
        self.batch_acc = math.nan
        self.model: nn.Module = nn.Identity()
        self.optimizer: torch.optim.Optimizer | None = None
        self._costs: dict[str, float] = {}
        """Relative work of each step kind (see :meth:`step_cost`), counted at setup."""

    def _build(self, ctx: TaskContext) -> None:
        self.model = self._new_model(self.device)
        self.optimizer = self._new_optimizer(self.model)
        forward = self._segment_costs(self.batch_size)
        backward = sum(backward_cost(cost, first=k == 0) for k, cost in enumerate(forward))
        params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self._costs = {"": sum(forward) + backward + params * UPDATE_COST_PER_ELEMENT}
        logger.info("[setup] %s: %s on %s, batch %d", type(self).__name__, self.arch, self.device, self.batch_size)

    def _segment_costs(self, batch: int) -> list[float]:
        return segment_costs(self.arch, num_classes=self.num_classes, batch=batch, image_size=self.image_size)

    def step_cost(self, kind: str) -> float | None:
        """Multiply-adds of the step's layers for its batch; None for a kind this task never runs."""
        return self._costs.get(kind)

    def _fit_step(self) -> None:
        """One SGD step on the next training batch."""
        if self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__}: step() before setup()")
        x, y = self.train.batch(self.cursor.take(self.batch_size))
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self.model.train()
        logits = self.model(x)
        loss = F.cross_entropy(logits, y)
        self.optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)
        self.optimizer.step()
        self.loss = loss.item()  # also waits for the step's kernels
        self.batch_acc = float((logits.argmax(1) == y).float().mean())
        self.loss_ema = self.loss if math.isnan(self.loss_ema) else _EMA * self.loss_ema + (1 - _EMA) * self.loss

    def _capture_common(self) -> dict[str, Any]:
        return {
            "fingerprint": self._fingerprint(),
            "model": self.model.state_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
            "position": self.cursor.position,
            "steps": self.done_steps,
            "loss": self.loss,
            "loss_ema": self.loss_ema,
            "batch_acc": self.batch_acc,
            "rng": capture_rng(self.device),
        }

    def _restore_common(self, state: dict[str, Any]) -> None:
        check_fingerprint(state, self._fingerprint())
        self.model.load_state_dict(state["model"])
        if state["optimizer"] is None:
            self.optimizer = None
        else:
            self.optimizer = self.optimizer or self._new_optimizer(self.model)
            self.optimizer.load_state_dict(state["optimizer"])
        self.cursor.position = int(state["position"])
        self.done_steps = int(state["steps"])
        self.loss, self.loss_ema = float(state["loss"]), float(state["loss_ema"])
        self.batch_acc = float(state["batch_acc"])
        restore_rng(state["rng"], self.device)
