"""An optimizer's update applied to a few parameters at a time.

``optimizer.step()`` updates every parameter of every group; here the groups
are narrowed to a run of parameters for one call and restored after it. For
the per-parameter optimizers (SGD, Adam, AdamW, RMSprop, Adagrad, ...) the
result is element for element that of one full step: each parameter's update
reads only its own gradient and state. Optimizers that look at all parameters
at once (LBFGS) are refused.
"""

from __future__ import annotations

import copy
import time

import torch

__all__ = ["ChunkedUpdate"]

_WHOLE_STEP = (torch.optim.LBFGS,)


class ChunkedUpdate:
    """Runs ``optimizer``'s step over parameters ``[lo, hi)`` of :attr:`params` (group order)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, _WHOLE_STEP):
            raise ValueError(
                f"{type(optimizer).__name__} updates all parameters together (it needs a closure); a partitioned"
                " task needs a per-parameter optimizer such as SGD, Adam or AdamW"
            )
        self.optimizer = optimizer
        seen: set[int] = set()
        self.params: list[torch.Tensor] = []
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    self.params.append(p)

    def step(self, lo: int, hi: int) -> None:
        """Update parameters ``lo`` to ``hi - 1`` (those with a gradient)."""
        chosen = {id(p) for p in self.params[lo:hi]}
        groups = self.optimizer.param_groups
        kept = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = [p for p in g["params"] if id(p) in chosen]
            self.optimizer.step()
        finally:
            for g, params in zip(groups, kept, strict=True):
                g["params"] = params

    def profile(self, device: torch.device) -> list[float]:
        """Seconds each parameter's update takes (the second of two runs); parameters and state are restored."""
        state = copy.deepcopy(self.optimizer.state_dict())
        values = [p.detach().clone() for p in self.params]
        grads = [p.grad for p in self.params]
        costs = [0.0] * len(self.params)
        clock = time.process_time if device.type == "cpu" else time.perf_counter  # as plan.timer
        try:
            for p in self.params:
                p.grad = torch.zeros_like(p)
            for run in range(2):
                for i in range(len(self.params)):
                    t0 = clock()
                    self.step(i, i + 1)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if run:
                        costs[i] = clock() - t0
        finally:
            with torch.no_grad():
                for p, value, grad in zip(self.params, values, grads, strict=True):
                    p.copy_(value)
                    p.grad = grad
            self.optimizer.load_state_dict(state)
        return costs

    @staticmethod
    def chunks(costs: list[float], target_s: float) -> list[tuple[int, int, float]]:
        """Runs ``(lo, hi, cost)`` of consecutive parameters under ``target_s`` (a slower one alone)."""
        out: list[tuple[int, int, float]] = []
        lo, total = 0, 0.0
        for i, cost in enumerate(costs):
            if i > lo and total + cost > target_s:
                out.append((lo, i, total))
                lo, total = i, 0.0
            total += cost
        if lo < len(costs):
            out.append((lo, len(costs), total))
        return out
